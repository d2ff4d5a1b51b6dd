"""RUN_DIR/pids.json is rewritten atomically when a lost process is replaced: a reader polling it (a
test, an operator's script) never sees it empty or half-written."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace

from mas_async.launch.launcher import write_pids


def test_a_reader_never_sees_pids_json_half_written(tmp_path) -> None:
    children = [SimpleNamespace(name=f"env_worker/{i}", pid=1000 + i) for i in range(64)]
    write_pids(tmp_path, children)
    bad: list[str] = []
    done = threading.Event()

    def read() -> None:
        while not done.is_set():
            text = (tmp_path / "pids.json").read_text()
            try:
                json.loads(text)
            except ValueError:
                bad.append(text)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for round_ in range(300):  # bounded: 300 rewrites, as many replacements
            children[round_ % 64].pid += 1
            write_pids(tmp_path, children)
    finally:
        done.set()
        reader.join(timeout=10)
    assert not bad, f"{len(bad)} reads saw a partial file, e.g. {bad[0][:40]!r}"
    assert json.loads((tmp_path / "pids.json").read_text())["env_worker/0"] == 1000 + 5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pids.json"]
