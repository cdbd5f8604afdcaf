// npm pack's prepack/postpack: the repository's docs/export.md (what the README links to) goes
// into the package as docs/export.md, and is removed after packing (the repository keeps one copy).
import { copyFile, mkdir, rm } from 'node:fs/promises';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';

const JS = join(dirname(fileURLToPath(import.meta.url)), '..');
const DOCS = ['export.md'];

if (process.argv[2] === 'copy') {
  await mkdir(join(JS, 'docs'), { recursive: true });
  for (const name of DOCS) await copyFile(join(JS, '..', 'docs', name), join(JS, 'docs', name));
} else if (process.argv[2] === 'clean') {
  await rm(join(JS, 'docs'), { recursive: true, force: true });
} else {
  console.error('usage: node scripts/pack-docs.js copy|clean');
  process.exit(2);
}
