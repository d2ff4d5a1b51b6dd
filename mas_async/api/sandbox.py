"""The sandbox, as envs reach it: run model-written code isolated (`run_python`), judge a program
against unit tests outside its process (`run_tests`). The service itself is `mas_async.sandbox`
(docs/sandbox.md); envs import it from here only, as they import everything else of the framework."""

from mas_async.sandbox import (
    Limits,
    RunCache,
    SandboxResult,
    SandboxUnavailable,
    require_isolation,
    run_python,
    run_python_sync,
    run_sync,
)
from mas_async.sandbox.tests import is_function_test, normalise_output, run_tests, run_tests_on_constant

__all__ = [
    "Limits",
    "RunCache",
    "SandboxResult",
    "SandboxUnavailable",
    "is_function_test",
    "normalise_output",
    "require_isolation",
    "run_python",
    "run_python_sync",
    "run_sync",
    "run_tests",
    "run_tests_on_constant",
]
