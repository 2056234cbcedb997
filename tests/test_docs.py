"""The documentation site builds with `--strict` (mkdocs.yml turns a link to a missing page,
file or anchor into a warning, and strict into a failure), its generated pages hold what
users look up there, and the README's links point at files that exist."""

import os
import re
import subprocess
import sys

from conftest import REPO


def test_the_site_builds_strict_with_no_broken_link(tmp_path):
    site = tmp_path / "site"
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1800,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    reference = (site / "configuration" / "index.html").read_text(encoding="utf-8")
    for key in ("algorithm.kl.coef", "trainer.fsdp.shard_size", "task.rewards[].weight", "env.num_workers"):
        assert f"<code>{key}</code>" in reference, key
    home = (site / "index.html").read_text(encoding="utf-8")  # README.md, its docs/ links made relative
    assert "Two commands" in home and 'href="getting-started/"' in home
    api = (site / "api" / "index.html").read_text(encoding="utf-8")
    assert "load_config" in api and "ConfigError" in api and "distflow.api.train" in api


def test_the_readme_links_to_files_that_exist():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    targets = [
        target.split("#", 1)[0]
        for target in re.findall(r"\]\(([^)\s]+)\)", readme)
        if not target.startswith(("http://", "https://", "#"))
    ]
    assert "docs/getting-started.md" in targets
    assert [target for target in targets if not (REPO / target).exists()] == []


def test_the_api_page_example_runs():
    """The Python API page's example builds configs as it says."""
    page = (REPO / "docs" / "api.md").read_text(encoding="utf-8")
    blocks = [block.split("```", 1)[0] for block in page.split("```python\n")[1:]]
    code = next(block for block in blocks if "load_config" in block)  # the training example is test_python_api's
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        namespace = {}
        exec(compile(code, "docs/api.md", "exec"), namespace)
    finally:
        os.chdir(cwd)
    assert namespace["config"].trainer.prompts_per_step == 16
