"""report.html: self-contained, opened in headless Chromium with no console errors and rendered plots.

Chromium comes from Debian's `chromium` package; the `chromium` fixture installs it with apt-get
the first time (as root, which CI is) and skips, saying why, where that cannot be done.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from adarl.report import COLORS, render, write_report
from test_compare import write_comparison, write_run

pytestmark = pytest.mark.heavy

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
INSTALL_LOCK = Path(tempfile.gettempdir()) / "adarl-chromium-install.lock"
INSTALL_FAILED = Path(tempfile.gettempdir()) / "adarl-chromium-install.failed"
RETRY_AFTER_S = 3600  # a failed install is not retried by every test run within the hour


def _find_chromium() -> str | None:
    return next((p for p in map(shutil.which, CHROMIUM_NAMES) if p), None)


def _install_chromium() -> str | None:
    """apt-get install chromium (once: later callers wait on the lock); the reason it failed otherwise."""
    if os.geteuid() != 0:
        return "chromium is not installed, and installing it (apt-get install chromium) needs root"
    if shutil.which("apt-get") is None:
        return "chromium is not installed and there is no apt-get to install it with"
    with INSTALL_LOCK.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _find_chromium():
            return None
        if INSTALL_FAILED.exists() and time.time() - INSTALL_FAILED.stat().st_mtime < RETRY_AFTER_S:
            return f"installing chromium failed recently: {INSTALL_FAILED.read_text()[-500:]}"
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for cmd in (["apt-get", "update", "-qq"],
                    ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "chromium", "fonts-dejavu-core"]):
            try:
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
            except (OSError, subprocess.TimeoutExpired) as err:
                INSTALL_FAILED.write_text(f"{' '.join(cmd)}: {err}")
                return f"installing chromium failed: {err}"
            if proc.returncode != 0:
                INSTALL_FAILED.write_text(f"{' '.join(cmd)}: exit {proc.returncode}\n{proc.stderr}")
                return f"installing chromium failed ({' '.join(cmd)}: exit {proc.returncode}): {proc.stderr[-300:]}"
    return None if _find_chromium() else "apt-get installed chromium but no chromium binary is on PATH"


@pytest.fixture(scope="session")
def chromium() -> str:
    path = _find_chromium()
    if path is None:
        reason = _install_chromium()
        path = _find_chromium()
        if path is None:
            pytest.skip(reason or "chromium unavailable")
    return path


def _run_chromium(binary: str, url: str, tmp: Path, *extra: str) -> subprocess.CompletedProcess:
    profile = tempfile.mkdtemp(prefix="chromium-profile-", dir=tmp)
    cmd = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
           "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage", "--hide-scrollbars",
           "--mute-audio", f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0", *extra, url]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=90)
    with contextlib.suppress(OSError):
        shutil.rmtree(profile)
    return proc


def _console_problems(stderr: str) -> list[str]:
    """Console messages and failed loads that Chromium logged (the page itself logs nothing)."""
    return [line for line in stderr.splitlines()
            if ":CONSOLE" in line or "Uncaught" in line or "Failed to load resource" in line or "net::ERR_" in line]


PROBE = """<script>
window.addEventListener('load', () => {
  const imgs = Array.from(document.images);
  const ok = imgs.filter(i => i.complete && i.naturalWidth > 0).length;
  document.body.setAttribute('data-probe', ok + '/' + imgs.length);
});
</script>"""


def _images_rendered(binary: str, html_path: Path, tmp: Path) -> tuple[str, str]:
    """Open a copy of the page with a probe that counts the images the browser decoded: ('ok/total', stderr)."""
    probe = tmp / f"probe-{html_path.stem}.html"
    probe.write_text(html_path.read_text().replace("</body>", PROBE + "</body>"))
    proc = _run_chromium(binary, probe.as_uri(), tmp, "--dump-dom", "--virtual-time-budget=5000")
    found = re.search(r'data-probe="(\d+/\d+)"', proc.stdout)
    return (found.group(1) if found else "no probe result"), proc.stderr


def _color_pixels(png: Path, hex_color: str, tol: float = 10 / 255) -> int:
    import matplotlib.image

    img = matplotlib.image.imread(str(png))[..., :3]
    rgb = np.array([int(hex_color[i:i + 2], 16) for i in (1, 3, 5)]) / 255
    return int((np.abs(img - rgb).max(axis=-1) < tol).sum())


# ---------------------------------------------------------------- the page itself


def test_report_is_self_contained_with_every_panel(tmp_path):
    run = write_run(tmp_path / "run", {0: 0.2, 3: 0.5, 6: 0.7}, steps=6, tokens_per_step=120, name="solo",
                    prompts=True, eval_json=True)
    path = write_report(run)
    text = path.read_text()
    assert path == run / "report.html"
    # no external resource of any kind: every src is an embedded PNG, no URL at all
    assert re.findall(r'\b(?:src|href)\s*=\s*"(?!data:image/png;base64,)', text) == []
    assert "http://" not in text and "https://" not in text and "<link" not in text and "@import" not in text
    images = re.findall(r'src="data:image/png;base64,([^"]+)"', text)
    assert len(images) == 8  # 7 curve panels + the heat maps
    for b64 in images:
        assert base64.b64decode(b64)[:8] == b"\x89PNG\r\n\x1a\n"
    for caption in ("Held-out greedy pass@1", "Training reward", "pass@k", "Response length", "entropy",
                    "Zero-variance", "Rollouts per prompt", "Prompt × step"):
        assert caption in text
    assert "no per-prompt log" not in text and "Nothing to draw" not in text
    assert "advantage.name" in text  # the resolved recipe table


def test_comparison_report_without_per_prompt_log_says_so(tmp_path):
    out = write_comparison(tmp_path / "cmp")
    text = render(out)
    assert "A (mean of 3 seeds)" not in text  # legends live in the PNGs; the page has the summary table
    assert "<td>A</td><td>3/3</td><td>0.600 [0.352, 0.848]</td>" in text
    assert text.count("has no per-prompt log") == 2  # one note per recipe instead of a heat map
    assert 'class="diff"' in text  # advantage.name differs between A and B
    assert "No eval*.json" in text


def test_comparison_report_has_paired_differences_and_run_intervals(tmp_path):
    out = write_comparison(tmp_path / "cmp")
    text = render(out)
    # B - A per seed at 400 tokens: 0.16667, 0.03333 -> +0.100 [-0.747, +0.947], 2 wins (see test_compare)
    assert ("<td>B</td><td>2</td><td>+0.100 [-0.747, +0.947] 2/0/0</td><td>no winner (interval spans 0)</td>"
            in text)
    assert "Against the baseline A" in text
    # per run: A seed0's 0.5 at 400 tokens on its 50 held-out problems, Wilson 95% [0.366, 0.634]
    assert "<td>A</td><td>0</td><td>finished</td><td>0.500 [0.366, 0.634]</td><td>50</td>" in text
    # a saved baseline is used when the report is rewritten
    saved = json.loads((out / "comparison.json").read_text())
    (out / "comparison.json").write_text(json.dumps({**saved, "baseline": "B"}))
    assert "Against the baseline B" in render(out)


def test_report_of_a_directory_that_is_neither(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="neither a run directory"):
        write_report(tmp_path / "empty")


def test_cli_report_of_a_run_and_of_a_comparison(tmp_path):
    """`adarl report DIR` in its own process: the page of a run, of a comparison, and exit 2 for neither."""
    run = write_run(tmp_path / "run", {0: 0.2, 3: 0.5}, steps=3, tokens_per_step=120, name="solo")
    out = write_comparison(tmp_path / "cmp")
    (tmp_path / "empty").mkdir()
    env = {**os.environ, "COLUMNS": "200"}
    said = {}
    for name in ("run", "cmp", "empty"):
        proc = subprocess.run([sys.executable, "-m", "adarl.cli", "report", str(tmp_path / name)], env=env,
                              capture_output=True, text=True, timeout=300)
        said[name] = proc
    assert said["run"].returncode == 0, said["run"].stderr
    assert said["run"].stdout == f"wrote {run / 'report.html'}\n"
    assert "Held-out greedy pass@1" in (run / "report.html").read_text()
    assert said["cmp"].returncode == 0, said["cmp"].stderr
    assert said["cmp"].stdout == f"wrote {out / 'report.html'}\n"
    assert "<td>A</td><td>3/3</td>" in (out / "report.html").read_text()  # the comparison's summary table
    assert said["empty"].returncode == 2 and "neither a run directory" in said["empty"].stderr
    assert "Traceback" not in said["empty"].stderr and not (tmp_path / "empty" / "report.html").exists()


# ---------------------------------------------------------------- in a browser


def test_report_renders_in_headless_chromium(chromium, tmp_path):
    out = write_comparison(tmp_path / "cmp", prompts=True, eval_json=True)
    page = write_report(out)
    shot = tmp_path / "report.png"
    proc = _run_chromium(chromium, page.as_uri(), tmp_path, f"--screenshot={shot}", "--window-size=1200,2000")
    assert shot.is_file(), proc.stderr[-2000:]
    assert _console_problems(proc.stderr) == []

    rendered, stderr = _images_rendered(chromium, page, tmp_path)
    assert rendered == "9/9", stderr[-2000:]  # 7 curve panels + one heat map per recipe, all decoded
    assert _console_problems(stderr) == []

    # the screenshot shows the plots: the two recipes' line colours cover many pixels, the page is not blank
    import matplotlib.image

    img = matplotlib.image.imread(str(shot))[..., :3]
    assert img.shape[:2] == (2000, 1200)
    assert (img.min(axis=-1) < 0.9).mean() > 0.05
    assert _color_pixels(shot, COLORS[0]) > 1000 and _color_pixels(shot, COLORS[1]) > 1000
    keep = os.environ.get("ADARL_KEEP_SCREENSHOT")
    if keep:
        shutil.copy(shot, keep)


def test_console_errors_and_broken_images_are_detected(chromium, tmp_path):
    """The checks above can fail: a page with a script error and a broken image trips both."""
    bad = tmp_path / "bad.html"
    bad.write_text('<!DOCTYPE html><html><body><img src="data:image/png;base64,AAAA">'
                   "<script>throw new Error('boom')</script></body></html>")
    rendered, stderr = _images_rendered(chromium, bad, tmp_path)
    assert rendered == "0/1"
    assert any("boom" in line for line in _console_problems(stderr)), stderr[-2000:]


def test_band_is_mean_min_max_over_the_steps_all_seeds_share():
    from adarl.report import band

    a = (np.array([0, 2, 4]), np.array([0, 300, 700]), np.array([0.2, 0.4, 0.6]))
    b = (np.array([0, 2, 4, 6]), np.array([0, 200, 500, 800]), np.array([0.3, 0.2, 0.8, 0.9]))
    x, mean, lo, hi = band([a, b])
    np.testing.assert_allclose(x, [0, 250, 600])
    np.testing.assert_allclose(mean, [0.25, 0.3, 0.7])
    np.testing.assert_allclose(lo, [0.2, 0.2, 0.6])
    np.testing.assert_allclose(hi, [0.3, 0.4, 0.8])
