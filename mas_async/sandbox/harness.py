"""The function-test harness, run inside the sandbox as a program's main (`tests.py` gives it its job).

Standard library only; its source is the run's main.py and its job is the file job.json. Two modes, in
two different sandbox runs, so that a program never shares a process with the code that judges it:

- record: load the program (its namespace, as module `__solution__`), then run each test with the
  entry point (`entry`: a function, or a class such as `Solution`) wrapped by a recorder, and write
  what each call of it did as data: ["value", args, result] or ["raise", args, exception type name]
  (args and results encoded by `encode`: plain data only). The tests given here have their asserts
  cut down to the calls they make (`tests.py`): the expected values are not in this process.
  The recorder returns `decode(encode(result))`, what the judge will see, so the test's later calls
  are those that the judge's run makes too.
- judge: no program here. Run each original test with the entry point replaced by a replayer that
  answers each call with the recorded answer for the same arguments (the first not yet used, in
  order), raising the recorded exception, and fails the test when the program made no such call. Or,
  with `constant`, every call answers that value (a constant-returning wrong program, without running
  one). Write one verdict per test.

Each test runs under its own alarm (`per_test_s`) with `random` seeded alike in both modes. Lines
written are "<nonce> <json>" on a duplicate of stdout taken before the program runs.
"""

import json
import os
import random
import signal
import sys

MAX_CALLS = 10000  # per test
MAX_DEPTH = 40


class TestTimeout(BaseException):
    pass


class Missing(Exception):
    """The judge's test made a call that the program's run did not."""


class Opaque:
    """A value that is not plain data (an object of the program's own class, a generator, ...): it
    equals nothing, as no expected value can be checked against it outside the program's process."""

    def __init__(self, kind):
        self.kind = kind

    def __eq__(self, other):
        return False

    def __hash__(self):
        return hash(self.kind)

    def __repr__(self):
        return f"<{self.kind}>"


def encode(value, depth=0):
    """Plain data as JSON-ready tagged lists; anything else as ["opaque", type name]."""
    kind = type(value)
    if depth > MAX_DEPTH:
        return ["opaque", "too deep"]
    if value is None or kind is bool or kind is str:
        return value
    if kind is int:
        return ["int", str(value)]
    if kind is float:
        return ["float", repr(value)]
    if kind is complex:
        return ["complex", repr(value)]
    if kind is bytes:
        return ["bytes", value.hex()]
    if kind in (list, tuple, set, frozenset):
        items = sorted(value, key=repr) if kind in (set, frozenset) else value
        return [kind.__name__, [encode(v, depth + 1) for v in items]]
    if kind is dict:
        return ["dict", [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]]
    if kind.__module__ == "numpy" and hasattr(value, "tolist"):
        return encode(value.tolist(), depth + 1)
    return ["opaque", kind.__name__]


def decode(data):
    if data is None or isinstance(data, (bool, str)):
        return data
    tag, body = data
    if tag == "int":
        return int(body)
    if tag == "float":
        return float(body)
    if tag == "complex":
        return complex(body)
    if tag == "bytes":
        return bytes.fromhex(body)
    if tag in ("list", "tuple", "set", "frozenset"):
        return {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}[tag](decode(v) for v in body)
    if tag == "dict":
        return {decode(k): decode(v) for k, v in body}
    return Opaque(body)


def exception_named(name):
    """An exception of the recorded type: the builtin of that name, else a class of that name."""
    found = getattr(__builtins__, name, None) if not isinstance(__builtins__, dict) else __builtins__.get(name)
    if isinstance(found, type) and issubclass(found, BaseException):
        return found
    return type(name, (Exception,), {})


class Recorder:
    """The entry point, recording each call of it (and of the methods of what a class call returns)."""

    def __init__(self, target, calls):
        self.target, self.calls = target, calls

    def __call__(self, *args, **kwargs):
        if len(self.calls) >= MAX_CALLS:
            raise RuntimeError("too many calls")
        given = encode([list(args), kwargs])
        try:
            result = self.target(*args, **kwargs)
        except TestTimeout:
            raise
        except BaseException as error:
            self.calls.append(["raise", given, type(error).__name__])
            raise
        if isinstance(self.target, type) and isinstance(result, self.target):
            self.calls.append(["object", given])
            return Instance(result, self.calls)
        answer = encode(result)
        self.calls.append(["value", given, answer])
        return decode(answer)


class Instance:
    """An object the entry class made: its methods are recorded as calls too."""

    def __init__(self, target, calls):
        self._target, self._calls = target, calls

    def __getattr__(self, name):
        attribute = getattr(self._target, name)
        return Recorder(attribute, self._calls) if callable(attribute) else attribute


class Replayer:
    """The judge's entry point: answers from a recording, or a constant for every call."""

    def __init__(self, calls, constant):
        self.calls, self.constant, self.used = calls, constant, set()

    def __call__(self, *args, **kwargs):
        if self.constant is not None:
            return decode(self.constant[0])
        given = encode([list(args), kwargs])
        for index, call in enumerate(self.calls):
            if index not in self.used and call[1] == given:
                self.used.add(index)
                if call[0] == "raise":
                    raise exception_named(call[2])("raised by the program")
                if call[0] == "object":
                    return Answers(self)
                return decode(call[2])
        raise Missing("the program made no such call")


class Answers:
    """The judge's stand-in for an object of the entry class: each method call is replayed."""

    def __init__(self, replayer):
        self._replayer = replayer

    def __getattr__(self, name):
        return self._replayer


class Constructor:
    """A constant-returning class: what it makes answers every method call with the constant."""

    def __init__(self, replayer):
        self._replayer = replayer

    def __call__(self, *args, **kwargs):
        return Answers(self._replayer)


def _alarm(signum, frame):
    raise TestTimeout()


def _run_test(code, index, namespace, per_test_s):
    random.seed(index)
    signal.setitimer(signal.ITIMER_REAL, per_test_s)
    try:
        exec(compile(code, f"test_{index}.py", "exec"), namespace)
        return True
    except BaseException:
        return False
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def record(job, out):
    namespace = {"__name__": "__solution__"}
    signal.setitimer(signal.ITIMER_REAL, job["per_test_s"])
    try:
        exec(compile(job["program"], "solution.py", "exec"), namespace)
        signal.setitimer(signal.ITIMER_REAL, 0)
        target = namespace[job["entry"]]
    except BaseException as error:
        signal.setitimer(signal.ITIMER_REAL, 0)
        out({"load": type(error).__name__})
        return
    for index, code in enumerate(job["tests"]):
        calls = []
        scope = dict(namespace)
        scope[job["entry"]] = Recorder(target, calls)
        _run_test(code, index, scope, job["per_test_s"])
        out({"test": index, "calls": calls})


def judge(job, out):
    context = {"__name__": "__solution__"}
    try:
        exec(compile(job["prompt"], "prompt.py", "exec"), context)  # helpers the tests may call
    except BaseException:
        context = {"__name__": "__solution__"}
    constant = job.get("constant")
    for index, code in enumerate(job["tests"]):
        calls = job["recordings"][index] if constant is None else []
        scope = dict(context)
        replayer = Replayer(calls, constant)
        scope[job["entry"]] = Constructor(replayer) if constant is not None and job["entry_is_class"] else replayer
        out({"test": index, "passed": _run_test(code, index, scope, job["per_test_s"])})


def main():
    with open("job.json") as f:
        job = json.load(f)
    os.remove("job.json")
    channel = os.dup(1)
    nonce = job["nonce"]

    def out(message):
        os.write(channel, f"\n{nonce} {json.dumps(message)}\n".encode())

    signal.signal(signal.SIGALRM, _alarm)
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 3000))
    (record if job["mode"] == "record" else judge)(job, out)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
