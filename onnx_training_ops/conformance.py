"""Run the ONNX conformance cases of the training domain through :mod:`onnx_training_ops.backend`."""

from __future__ import annotations

import re
import unittest
from dataclasses import dataclass

NODE_CASES = (
    "test_adagrad",
    "test_adagrad_multiple",
    "test_adam",
    "test_adam_multiple",
    "test_momentum",
    "test_momentum_multiple",
    "test_nesterov_momentum",
)
GRADIENT_CASES = ("test_gradient_of_add", "test_gradient_of_add_and_mul")
CASES = NODE_CASES + GRADIENT_CASES
PATTERN = "^(" + "|".join(CASES) + ")_cpu$"


@dataclass
class CaseResult:
    name: str
    passed: bool
    detail: str = ""


def backend_test_cases(module_name: str = __name__, portable: bool = False) -> dict[str, type[unittest.TestCase]]:
    """The unittest classes of onnx's BackendTest for the domain's cases, on this package's backend.

    Put ``globals().update(backend_test_cases(__name__))`` in a test module: pytest or unittest
    then runs exactly the domain's 9 cases, without onnx's ~4,000 others.

    Args:
        module_name: the module the classes are made for (the caller's ``__name__``).
        portable: run the cases on the portable form
            (:class:`~onnx_training_ops.backend.PortableBackend`).

    Returns:
        Class name -> ``unittest.TestCase`` class.
    """
    import warnings

    import onnx.backend.test

    from . import backend

    with warnings.catch_warnings():  # building onnx's in-memory cases warns about other ops' data
        warnings.simplefilter("ignore", RuntimeWarning)
        suite = onnx.backend.test.BackendTest(backend.PortableBackend if portable else backend.TrainingBackend,
                                              module_name)
    suite.include(PATTERN)
    cases = {}
    for name, case_class in suite.test_cases.items():
        # BackendTest keeps every other case as a skipped test; keep only the domain's
        for attribute in [a for a in vars(case_class) if a.startswith("test_")]:
            if not re.match(PATTERN, attribute):
                delattr(case_class, attribute)
        if any(a.startswith("test_") for a in vars(case_class)):
            cases[name] = case_class
    return cases


def run_conformance(portable: bool = False) -> list[CaseResult]:
    """Run every case of :data:`CASES`; one result per case, in that order (``portable``: on
    the portable form, in plain onnxruntime)."""
    results: dict[str, CaseResult] = {}
    for case_class in backend_test_cases(portable=portable).values():
        for test_name in unittest.defaultTestLoader.getTestCaseNames(case_class):
            name = re.sub(r"_cpu$", "", test_name)
            if name not in CASES:
                continue
            outcome = unittest.TestResult()
            case_class(test_name).run(outcome)
            problems = outcome.errors + outcome.failures
            skipped = outcome.skipped
            if problems:
                detail = problems[0][1].strip().splitlines()[-1]
                results[name] = CaseResult(name, False, detail)
            elif skipped:
                results[name] = CaseResult(name, False, f"skipped: {skipped[0][1]}")
            else:
                results[name] = CaseResult(name, True)
    return [results.get(name, CaseResult(name, False, "not found in this onnx's test cases")) for name in CASES]


def format_table(results: list[CaseResult]) -> str:
    """A plain-text pass/fail table with a closing 'N passed, N failed' line."""
    width = max(len(r.name) for r in results)
    lines = [f"{'case':<{width}}  result", f"{'-' * width}  ------"]
    for r in results:
        lines.append(f"{r.name:<{width}}  {'pass' if r.passed else 'FAIL'}" + (f"  {r.detail}" if r.detail else ""))
    passed = sum(r.passed for r in results)
    lines.append(f"conformance: {passed} passed, {len(results) - passed} failed")
    return "\n".join(lines)
