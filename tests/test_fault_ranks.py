"""Fault suite, ranks (issue 20 item 2): data-parallel ranks opened on different models. Before
the fix another hidden size or optimizer on one rank ended in gloo's SIGABRT, and another
activation trained 20 steps with ``check_parameters`` passing. Now every rank refuses the mix
at construction with one message naming the rank and the part that differs."""

from __future__ import annotations

import pytest

pytest.importorskip("torch.distributed")

from test_distributed import _launch_script  # noqa: E402

CASES = ["hidden", "momentum", "activation", "hidden-zero", "momentum-zero", "activation-zero",
         "other-seed", "base-zero"]
EXPECTED = {"hidden": "graph", "momentum": "optimizer (Momentum vs Adam)", "activation": "graph"}


def test_ranks_with_different_models_fail_cleanly_on_every_rank(tmp_path):
    done = _launch_script("_ddp_models_worker.py", 2, *CASES)
    for rank, proc in enumerate(done):
        assert proc.returncode == 0, f"rank {rank}: {proc.stderr[-2000:]}"
        lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
        assert list(lines) == CASES
        for case in CASES:
            variant = case.removesuffix("-zero")
            if variant in EXPECTED:
                assert lines[case].startswith("clean-error"), (case, lines[case])
                assert "rank 1 differs from rank 0 in" in lines[case] and EXPECTED[variant] in lines[case]
            else:  # same graph (other initial values: rank 0's are broadcast)
                assert lines[case].startswith("ran"), (case, lines[case])
    assert done[0].stdout == done[1].stdout  # the same outcome and digests on both ranks
