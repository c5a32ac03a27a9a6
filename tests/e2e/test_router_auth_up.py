"""`tandem up` guards its router by default: it makes a key file in its state directory and
the `local` key's plaintext only in `STATE_DIR/api-key` (both 0600). The status output
names that file, never the key; no stack process has the key on its command line or in
its log."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from tests.e2e.test_tandem_up import _descendants, _first_line

pytestmark = pytest.mark.e2e


def test_tandem_up_makes_a_key_and_shows_only_where_it_is(tmp_path: Path, tiny_model_dir: str) -> None:
    state = tmp_path / "state"
    status = tmp_path / "status.txt"
    env = {key: value for key, value in os.environ.items() if key != "TANDEM_API_KEYS_FILE"}
    with open(status, "w") as status_file:
        up = subprocess.Popen([sys.executable, "-m", "cli.main", "up", "--port", "0", "--metrics-port", "0",
                               "--model", tiny_model_dir, "--state-dir", str(state), "--engine", "sim",
                               "--workers", "1", "--prefill", "0", "--decode", "0"],
                              stdout=subprocess.PIPE, stderr=status_file, env={**env, "PYTHONUNBUFFERED": "1",
                                                                               "COLUMNS": "200"},
                              text=True, start_new_session=True)
        try:
            url = _first_line(up, 60)
            key_file = state / "api-key"
            key = key_file.read_text().strip()
            assert key.startswith("tdm_")
            for path in (key_file, state / "api-keys.jsonl"):
                assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
            assert key not in (state / "api-keys.jsonl").read_text()
            with openai.OpenAI(base_url=url, api_key="tdm_not-the-key", max_retries=0, timeout=30) as wrong:
                with pytest.raises(openai.AuthenticationError):
                    wrong.models.list()
            with openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=30) as api:
                model = api.models.list().data[0].id
                assert api.completions.create(model=model, prompt="Hi", max_tokens=2).usage.completion_tokens == 2
            descendants = _descendants(up.pid)
            command_lines = {pid: Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
                             for pid in [up.pid, *descendants] if Path(f"/proc/{pid}/cmdline").exists()}
            ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
        finally:
            up.send_signal(signal.SIGTERM)
            code = up.wait(90)
    assert code == 0
    assert any("--api-keys-file" in line for line in command_lines.values())  # the router got the path
    assert not any(key in line for line in command_lines.values()) and key not in ps
    printed = status.read_text()
    assert str(key_file.resolve()) in printed.replace("\n", "") and key not in printed
    for log in (state / "logs").glob("*.log"):
        assert key not in log.read_text(errors="replace"), log
