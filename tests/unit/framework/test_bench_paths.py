"""No path of a machine in a committed result: every file under results/ names a path as a user would (inside
the repository relative to it, else its last part), and the function the benches and `mas-async results`
write through (mas_async/machine_paths.py) does what it says."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from mas_async.launch.results import MACHINE_PATH
from mas_async.launch.results import without_machine_paths as exported
from mas_async.machine_paths import shown_path, without_machine_paths
from tests.support.paths import ROOT

MACHINE = re.compile(r"(?<![\w.\-/])/(tmp|root|home|work|private|Users)/|(?<![\w])[A-Za-z]:\\")
"""A machine's absolute path: a temp folder, a home, this workplace's /work, macOS's /private, a Windows drive."""


def _strings(value):
    """Every string of a JSON document, its keys included."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield key
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)
    elif isinstance(value, str):
        yield value


def machine_paths_in(path: Path) -> list[str]:
    """The machine paths `path` holds: in a JSON file its decoded strings (where `C:\\x` is written `C:\\\\x`
    and `\\n` is no drive), in any other text file its lines."""
    text = path.read_bytes().decode("utf-8", errors="ignore")
    if path.suffix == ".json":
        found = [s for s in _strings(json.loads(text)) if MACHINE.search(s)]
    elif path.suffix == ".jsonl":
        found = [
            s for line in text.splitlines() if line.strip() for s in _strings(json.loads(line)) if MACHINE.search(s)
        ]
    else:
        found = [line for line in text.splitlines() if MACHINE.search(line)]
    return found


def test_no_committed_result_holds_a_path_of_a_machine():
    files = [path for path in sorted((ROOT / "results").rglob("*")) if path.is_file()]
    assert len(files) > 80  # (the folder is there: an empty glob would pass)
    found = {str(path.relative_to(ROOT)): hits[:3] for path in files if (hits := machine_paths_in(path))}
    assert found == {}, f"{len(found)} files under results/ name a machine's path: {found}"


@pytest.mark.parametrize(
    "text",
    [
        '{"args": {"json": "/tmp/rv/scale-1.json"}}',
        '{"args": {"run_dir": "/work/runs/stale59/runs"}}',
        '{"/root/x": 1}',
        '{"model": "C:\\\\Users\\\\me\\\\model"}',
        '{"note": "written to /home/me/out.json"}',
        '{"dir": "/private/var/folders/x"}',
    ],
)
def test_the_check_finds_each_kind_of_machine_path(tmp_path: Path, text: str):
    (tmp_path / "f.json").write_text(text)
    assert machine_paths_in(tmp_path / "f.json")


def test_the_check_lets_names_a_user_gives_pass(tmp_path: Path):
    document = {"json": "results/bench/scale-1.json", "run_dir": "runs", "note": "line:\nnext", "url": "/v1/chat"}
    (tmp_path / "f.json").write_text(json.dumps(document))
    (tmp_path / "f.yaml").write_text("model: <machine path>/smollm2\nroot: results/tmp/x\n")
    assert machine_paths_in(tmp_path / "f.json") == [] and machine_paths_in(tmp_path / "f.yaml") == []
    (tmp_path / "f.yaml").write_text("cgroup: /home/me/mas\n")
    assert machine_paths_in(tmp_path / "f.yaml") == ["cgroup: /home/me/mas"]


def test_a_path_inside_the_repository_is_shown_relative_to_it(monkeypatch):
    assert shown_path(ROOT / "results" / "bench" / "scale-1.json") == "results/bench/scale-1.json"
    assert shown_path(str(ROOT / "configs" / "x.yaml")) == "configs/x.yaml"
    assert shown_path(f"{ROOT}/results/../configs/x.yaml") == "configs/x.yaml"
    monkeypatch.chdir(ROOT / "results")  # a relative path is taken from where the bench ran
    assert shown_path(Path("bench/scale-1.json")) == "results/bench/scale-1.json"


def test_any_other_path_keeps_only_its_last_part():
    assert shown_path("/tmp/rv/scale_ab/new-1.json") == "new-1.json"
    assert shown_path("/work/runs/stale59/runs") == "runs"
    assert shown_path("/tmp/rv/") == "rv"
    assert shown_path(Path("/root/models/smollm2")) == "smollm2"
    assert shown_path("~/models/smollm2") == "smollm2"
    assert shown_path("C:\\Users\\me\\model") == "model"
    assert shown_path("/tmp/rv/x.json", outside=MACHINE_PATH) == "<machine path>/x.json"


def test_what_a_bench_saves_loses_every_machine_path_and_nothing_else():
    saved = {
        "bench": "scale",
        "args": {"json": Path("/tmp/rv/scale-1.json"), "run_dir": "/work/runs/x/runs", "plot": None, "smoke": True},
        "inside": ROOT / "docs" / "images" / "scale.png",
        "points": [{"rps": 101.5, "cores": 0.25, "role": "router"}, ("a", 1)],
        "/tmp/a/key.json": "relative/kept.json",
    }
    assert without_machine_paths(saved) == {
        "bench": "scale",
        "args": {"json": "scale-1.json", "run_dir": "runs", "plot": None, "smoke": True},
        "inside": "docs/images/scale.png",
        "points": [{"rps": 101.5, "cores": 0.25, "role": "router"}, ["a", 1]],
        "key.json": "relative/kept.json",
    }
    assert not [s for s in _strings(json.loads(json.dumps(without_machine_paths(saved)))) if MACHINE.search(s)]


def test_the_results_export_writes_through_the_same_function():
    assert exported({"model": "/root/models/smollm2", "in": str(ROOT / "configs" / "x.yaml")}) == {
        "model": "<machine path>/smollm2",
        "in": "configs/x.yaml",
    }


def test_every_bench_that_saves_its_arguments_writes_them_through_the_function():
    """A bench's `vars(args)` holds `--json` and `--run-dir` as typed: a temp folder, a home."""
    missing = [
        path.name
        for path in sorted((ROOT / "bench").glob("*.py"))
        if "vars(args)" in (text := path.read_text()) and "json" in text and "without_machine_paths(" not in text
    ]
    assert missing == []


def test_a_bench_run_writes_its_json_path_as_its_last_part(tmp_path: Path):
    from bench import router_refill

    out = tmp_path / "figures.json"
    router_refill.main(
        ["--workers", "4", "--concurrent", "16", "--episodes", "50", "--repeat", "1", "--json", str(out)]
    )
    figures = json.loads(out.read_text())
    assert figures["args"]["json"] == "figures.json" and str(tmp_path) not in out.read_text()
