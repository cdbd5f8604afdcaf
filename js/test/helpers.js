// Where the Node tests find what Python wrote (OTO_FIXTURES), and how they read it; the browser tests'
// server and headless Chromium.
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { existsSync } from 'node:fs';
import { mkdtemp, readFile, rm, symlink } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';

export const FIXTURES = process.env.OTO_FIXTURES;
if (!FIXTURES) {
  throw new Error('OTO_FIXTURES is not set: write the fixtures first, e.g. `python tests/js_fixtures.py /tmp/fixtures` '
    + 'then `OTO_FIXTURES=/tmp/fixtures node --test js/test/` (make test-js does both)');
}
export const read = async (path) => new Uint8Array(await readFile(join(FIXTURES, path)));

export const REPO = resolve(dirname(fileURLToPath(import.meta.url)), '..', '..');
export const CHROMIUM = process.env.CHROMIUM ?? '/usr/bin/chromium';
// the flags this machine needs (closed network, root); each caller adds its GPU flag, a fresh profile each launch
const FLAGS = ['--headless', '--no-sandbox', '--disable-quic', '--no-first-run', '--disable-background-networking',
  '--disable-component-update', '--disable-sync'];

/** Serve `directory` on a free port of 127.0.0.1 (`python3 -m http.server`): `{ child, origin }`. */
export async function serve(directory) {
  const python = process.env.PYTHON ?? 'python3';
  const child = spawn(python, ['-u', '-m', 'http.server', '0', '--bind', '127.0.0.1', '--directory', directory],
    { stdio: ['ignore', 'pipe', 'pipe'] });
  try {
    const port = await new Promise((resolvePort, reject) => {
      let text = '';
      child.stdout.on('data', (chunk) => {
        text += chunk;
        const match = /port (\d+)/.exec(text);
        if (match) resolvePort(Number(match[1]));
      });
      child.on('exit', (code) => reject(new Error(`${python} -m http.server exited with ${code}`)));
      setTimeout(() => reject(new Error('http.server did not start in 20 s')), 20000);
    });
    child.stderr.resume();
    return { child, origin: `http://127.0.0.1:${port}` };
  } catch (error) {
    child.kill();
    throw error;
  }
}

/**
 * Headless Chromium (puppeteer-core) with this machine's flags, `flags` (e.g. '--disable-gpu') and a fresh
 * profile under a temporary folder named after `prefix`: `{ browser, close }`; close() also removes the profile.
 */
export async function launchChromium(prefix, flags) {
  assert.ok(existsSync(CHROMIUM), `no Chromium at ${CHROMIUM}: apt-get install -y chromium (make test does it)`);
  const { default: puppeteer } = await import('puppeteer-core');
  const profile = await mkdtemp(join(tmpdir(), `${prefix}-chromium-`));
  let browser;
  try {
    browser = await puppeteer.launch({ executablePath: CHROMIUM, headless: true,
      args: [...FLAGS, ...flags, `--user-data-dir=${profile}`] });
  } catch (error) {
    await rm(profile, { recursive: true, force: true });
    throw error;
  }
  return {
    browser,
    async close() {
      await browser.close();
      await rm(profile, { recursive: true, force: true });
    },
  };
}

/**
 * The browser tests' setup: a temporary folder linking the repository's js/ and examples/ and the fixtures,
 * served over http, and Chromium (see launchChromium): `{ browser, origin, root, close }`.
 */
export async function servedChromium(prefix, flags) {
  const root = await mkdtemp(join(tmpdir(), `${prefix}-serve-`));
  let server;
  try {
    await symlink(join(REPO, 'js'), join(root, 'js'));
    await symlink(join(REPO, 'examples'), join(root, 'examples'));
    await symlink(resolve(FIXTURES), join(root, 'fixtures'));
    server = await serve(root);
    const { browser, close } = await launchChromium(prefix, flags);
    return {
      browser,
      root,
      origin: server.origin,
      async close() {
        await close();
        server.child.kill();
        await rm(root, { recursive: true, force: true });
      },
    };
  } catch (error) {
    server?.child.kill();
    await rm(root, { recursive: true, force: true });
    throw error;
  }
}
