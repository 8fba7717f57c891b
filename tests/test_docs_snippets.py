"""The docs site cannot rot: its guides' snippets run, its settings page is complete.

Every `sh`/`bash` and `python` block of docs/index.md and docs/guides/ runs here
against the default model (SmolLM2-135M-Instruct), served once for the module,
with `127.0.0.1:8000` replaced by the test server's address. A block that needs
the server started as its guide says marks it on the line before its fence,
`<!-- run-with: --kv-bits 8 -->`, and runs against a server started with those
flags (one per set of flags). A block that cannot run on this machine (root, a
GPU, a Mac, a model too big, a real agent client, a server in the foreground)
says so there instead, `<!-- not-run: why -->`, and its test is skipped with
that reason: pytest's summary counts the exemptions and lists why. Where the
real command takes minutes, the guide shows a quick form that runs here.
Shell blocks run under `set -euo pipefail` with a `curl` that fails on an HTTP
error, so a snippet that gets an error object fails its test; HOME is a
temporary folder, so nothing lands in the user's caches.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from flashserve.engine.weights.sources import default_model_path
from flashserve.server.settings import Settings

from .conftest import REPO, Server, start_server, stop_server

DOCS = REPO / "docs"
PAGES = [DOCS / "index.md", *sorted((DOCS / "guides").rglob("*.md"))]
RUN_LANGS = {"sh": "sh", "bash": "sh", "shell": "sh", "python": "python", "py": "python"}
FENCE = re.compile(r"^```(\w*)[^\n]*$")
NOT_RUN = re.compile(r"^<!-- not-run: (.+?) -->$")
RUN_WITH = re.compile(r"^<!-- run-with: (.+?) -->$")
# The quick benchmark forms take up to a minute on two busy cores.
SNIPPET_TIMEOUT_S = 240
# The docs server's own flags: the prompt cache on (the prompt-cache guide shows a
# hit); replies kept short.
DOCS_SERVER_ARGS = ("--prompt-cache-bytes", "200MB", "--default-max-tokens", "64")
# Where the sections of the old, long README went (issue 45).
MOVED_FROM_README = [
    "guides/larger-than-memory.md",
    "guides/gguf-and-prepare.md",
    "guides/prompt-cache.md",
    "guides/agents/index.md",
    "guides/code-completion.md",
    "guides/tools-and-structured-output.md",
    "guides/clients.md",
    "guides/running-for-others.md",
    "guides/several-machines.md",
    "guides/cpu-and-gpu.md",
    "reference/settings.md",
    "reference/commands.md",
    "reference/endpoints.md",
    "reference/monitoring.md",
    "benchmarks/index.md",
    "benchmarks/expert-cache.md",
    "benchmarks/prefill-from-disk.md",
    "benchmarks/prompt-cache.md",
    "benchmarks/decode.md",
    "benchmarks/io.md",
    "development.md",
]
# Shell blocks: fail on the first failing command, and on any HTTP error status.
SH_PREAMBLE = 'set -euo pipefail\ncurl() { command curl -fsS "$@"; }\n'


@dataclass(frozen=True)
class Snippet:
    page: Path
    line: int
    lang: str  # "sh" or "python"; other languages are never run
    code: str
    not_run: str | None  # the reason, when marked
    server_args: tuple[str, ...] = ()  # run-with: the flags of the server it needs

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(DOCS)}:{self.line}"


def snippets(pages: list[Path] = PAGES) -> list[Snippet]:
    """Every fenced shell or Python block of the pages, with its not-run mark."""
    found = []
    for page in pages:
        lines = page.read_text().splitlines()
        i = 0
        while i < len(lines):
            match = FENCE.match(lines[i])
            if not match:
                i += 1
                continue
            end = i + 1
            while end < len(lines) and not lines[end].startswith("```"):
                end += 1
            lang = RUN_LANGS.get(match.group(1).lower())
            if lang:
                before = lines[i - 1].strip() if i else ""
                mark = NOT_RUN.match(before)
                flags = RUN_WITH.match(before)
                code = "\n".join(lines[i + 1 : end]) + "\n"
                found.append(
                    Snippet(
                        page,
                        i + 1,
                        lang,
                        code,
                        mark.group(1) if mark else None,
                        tuple(shlex.split(flags.group(1))) if flags else (),
                    )
                )
            i = end + 1
    return found


ALL = snippets()
RUNNABLE = [s for s in ALL if s.not_run is None]


@pytest.fixture(scope="module")
def docs_servers(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[[tuple[str, ...]], Server]]:
    """The default model served with the docs' flags plus a block's run-with flags: each
    set started once, when a block first needs it."""
    default_model_path()  # the README's test command installs it: missing is a failure
    started: dict[tuple[str, ...], Server] = {}

    def server(extra: tuple[str, ...]) -> Server:
        if extra not in started:
            workdir = tmp_path_factory.mktemp("docs-server")
            started[extra] = start_server(None, workdir, *DOCS_SERVER_ARGS, *extra)
        return started[extra]

    yield server
    for running in started.values():
        stop_server(running)


def run_snippet(snippet: Snippet, server: Server, cwd: Path) -> subprocess.CompletedProcess:
    code = snippet.code.replace("127.0.0.1:8000", server.url.removeprefix("http://"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHSERVE_")}
    # `flashserve` and `python` are this environment's, as after the install command.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["HOME"] = str(cwd)  # ~/.cache and the like: the test's, not the user's
    if snippet.lang == "sh":
        cmd = ["bash", "-c", SH_PREAMBLE + code]
    else:
        cmd = [sys.executable, "-c", code]
    return subprocess.run(
        cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=SNIPPET_TIMEOUT_S
    )


@pytest.mark.parametrize("snippet", ALL, ids=[s.name for s in ALL])
def test_guide_snippet_runs(
    snippet: Snippet, docs_servers: Callable[[tuple[str, ...]], Server], tmp_path: Path
) -> None:
    if snippet.not_run is not None:
        # Reported, with its reason, in pytest's summary (-ra): the exemptions counted.
        pytest.skip(f"{snippet.name} not run here: {snippet.not_run}")
    result = run_snippet(snippet, docs_servers(snippet.server_args), tmp_path)
    detail = (
        f"{snippet.name} (a block that cannot run here needs `<!-- not-run: why -->` on the"
        f" line before its fence)\n{snippet.code}\n"
        f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    )
    assert result.returncode == 0, detail
    # A guide's snippet shows the reader something; silence means it did nothing visible.
    assert result.stdout.strip(), detail


def test_snippet_extraction_and_marks(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "text\n```sh\necho run\n```\n<!-- not-run: needs a GPU -->\n```python\nprint(1)\n```\n"
        "```toml\nkey = 1\n```\n```\nplain\n```\n"
        "<!-- run-with: --kv-bits 8 --api-key 'a b' -->\n```bash\necho kv\n```\n"
    )
    found = snippets([page])
    assert [(s.lang, s.code, s.not_run, s.server_args) for s in found] == [
        ("sh", "echo run\n", None, ()),
        ("python", "print(1)\n", "needs a GPU", ()),
        ("sh", "echo kv\n", None, ("--kv-bits", "8", "--api-key", "a b")),
    ]
    assert [s.line for s in found] == [2, 6, 16]


def test_the_guides_have_runnable_snippets_and_every_mark_has_a_reason() -> None:
    everything = snippets()
    pages = {s.page.relative_to(DOCS).as_posix() for s in RUNNABLE}
    # The quick start and the guides keep their snippets runnable: each of these has
    # one at least (the last three's servers are started with the flags they show).
    for page in (
        "index.md",
        "guides/gguf-and-prepare.md",
        "guides/prompt-cache.md",
        "guides/speculative-decoding.md",
        "guides/kv-cache-quantization.md",
        "guides/memory-cap.md",
    ):
        assert page in pages, page
    assert len(RUNNABLE) >= 16
    for s in everything:
        assert s.not_run is None or len(s.not_run) > 5, s.name
    # A server or a chat in the foreground would block its test until the timeout.
    blocking = [
        s.name
        for s in RUNNABLE
        if re.search(r"flashserve (serve|chat)\b(?![^\n]*&\s*$)", s.code, flags=re.M)
    ]
    assert not blocking, f"mark these <!-- not-run: serves in the foreground -->: {blocking}"
    # A mark that is not on the line right before a fence marks nothing: a typo.
    for page in PAGES:
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            for word, mark in (("not-run", NOT_RUN), ("run-with", RUN_WITH)):
                if word in line:
                    assert mark.match(line.strip()), f"{page}:{i + 1}: {line}"
                    assert i + 1 < len(lines) and FENCE.match(lines[i + 1]), f"{page}:{i + 1}"


def _hook(name: str):
    path = REPO / "docs_hooks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_settings_page_lists_every_setting(tmp_path: Path) -> None:
    """The strict build passes, and its settings page has one row per setting."""
    site = tmp_path / "site"
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(site)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    page = (site / "reference" / "settings" / "index.html").read_text()
    assert "settings-table" not in page  # the placeholder was replaced
    rows = re.findall(r"<tr>\s*<td><code>([a-z_]+)</code></td>", page)
    assert sorted(rows) == sorted(Settings.model_fields)
    # Each row carries its default and its meaning.
    markdown = _hook("settings_reference").render_settings()
    for name, field in Settings.model_fields.items():
        (row,) = [line for line in markdown.splitlines() if line.startswith(f"| `{name}` |")]
        if isinstance(field.default, (int, float)) and not isinstance(field.default, bool):
            assert f"`{field.default}`" in row, row
        cells = [c.strip() for c in row.strip("|").split(" | ")]
        assert cells[3], f"{name} has no meaning on the settings page"


def test_readme_test_command_is_what_ci_runs() -> None:
    readme = (REPO / "README.md").read_text()
    ci = (REPO / ".ci" / "run").read_text()
    (command,) = [line for line in ci.splitlines() if line.startswith("python3 -m venv")]
    assert command in readme.splitlines()
    assert "mkdocs build --strict" in command
    assert len(readme.splitlines()) <= 260


def test_readme_links_reach_the_docs() -> None:
    """Every link of the README lands on a file, and a heading where it names one."""
    from markdown.extensions.toc import slugify

    readme = (REPO / "README.md").read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", readme)
    local = [link for link in links if not link.startswith(("http://", "https://"))]
    assert len(local) > 20  # the README is mostly a map of the docs
    for link in local:
        path, _, anchor = link.partition("#")
        target = REPO / path
        assert target.is_file(), link
        if anchor:
            headings = re.findall(r"^#+ (.+)$", target.read_text(), flags=re.M)
            assert anchor in {slugify(h, "-") for h in headings}, link
    # The pages that took the long README's sections are one click from it.
    for page in MOVED_FROM_README:
        assert f"docs/{page}" in local, page


def test_monitoring_page_names_every_response_field() -> None:
    """/memory and /cache/stats fields added to their response models reach the docs."""
    from pydantic import BaseModel

    from flashserve.server.routes import cache, memory

    page = (DOCS / "reference" / "monitoring.md").read_text()
    models = [
        obj
        for module in (memory, cache)
        for obj in vars(module).values()
        if isinstance(obj, type)
        and issubclass(obj, BaseModel)
        and obj.__module__ == module.__name__
    ]
    assert len(models) >= 5
    for model in models:
        for name in model.model_fields:
            if name == "layer":  # a per-layer list entry's own index
                continue
            assert re.search(rf"\b{name}\b", page), f"{model.__name__}.{name}"


def test_every_request_field_is_documented() -> None:
    """Each field a route accepts is named in the endpoints reference or a guide."""
    from flashserve.server.anthropic.protocol import CountTokensRequest, MessagesRequest
    from flashserve.server.llamacpp.protocol import InfillRequest
    from flashserve.server.openai.completions_protocol import CompletionRequest
    from flashserve.server.openai.protocol import ChatCompletionRequest
    from flashserve.server.openai.responses_protocol import ResponseCreateRequest

    pages = [DOCS / "reference" / "endpoints.md", *sorted((DOCS / "guides").rglob("*.md"))]
    text = "\n".join(page.read_text() for page in pages)
    requests = (
        ChatCompletionRequest,
        CompletionRequest,
        InfillRequest,
        ResponseCreateRequest,
        MessagesRequest,
        CountTokensRequest,
    )
    undocumented = [
        f"{model.__name__}.{name}"
        for model in requests
        for name in model.model_fields
        if not re.search(rf"\b{name}\b", text)
    ]
    assert not undocumented


def test_pages_left_out_of_the_nav_join_their_section(tmp_path: Path) -> None:
    nav_pages = _hook("nav_pages")
    (tmp_path / "guides").mkdir()
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "guides" / "listed.md").write_text("# Listed\n")
    (tmp_path / "guides" / "new-feature.md").write_text("Intro\n\n# New feature\n")
    (tmp_path / "benchmarks" / "new-run.md").write_text("no heading\n")
    nav = [{"Home": "index.md"}, {"Guides": [{"Listed": "guides/listed.md"}]}, {"Benchmarks": []}]
    assert nav_pages.unlisted_pages(tmp_path, nav) == {
        "Guides": [("New feature", "guides/new-feature.md")],
        "Benchmarks": [("New run", "benchmarks/new-run.md")],
    }
    config = {"nav": nav, "docs_dir": str(tmp_path)}
    nav_pages.on_config(config)
    assert config["nav"][1]["Guides"][-1] == {"New feature": "guides/new-feature.md"}
    assert config["nav"][2]["Benchmarks"] == [{"New run": "benchmarks/new-run.md"}]
