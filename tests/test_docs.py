"""The docs cannot rot unnoticed: what README.md and docs/*.md name must exist in the code.
The truths come from the code, never from a list kept here: the parsers of agent/cli.py
(walked, subcommand by subcommand), the Makefile's target lines, the metrics
agent/ops/metrics.py exports, the Event reasons the agent's calls record, and the files and
headings the links point to. Each check has a twin that feeds it a wrong snippet.

What counts as a mention (prose outside code is never read for commands or targets):
- a command line: in an inline code span or a line of a fenced code block, a word
  `natgw-agent` or `natgw-supervise` that starts it (after an optional `$` prompt, `sudo`
  or `VAR=value` words) or follows a `--` word (`kubectl exec ... -- natgw-agent show`);
  the words after it, up to `|`, `;`, `&&`, `||` or a `#` comment, are its arguments. Each
  option must be one the parser at that point knows (an option taking a value takes the
  next word), the first other word must be a subcommand, and `supervise` (or
  `natgw-supervise`) hands the rest to natgw-agent's parser. Words in capitals
  (`ARGS...`, `EIP:PORT/PROTO`) or with `<` are placeholders.
- a flag alone: an inline code span that starts with `--` names an option of one of
  natgw-agent's parsers (`--health-*`: any option starting with `--health-`).
- a make target: in code, `make`, optional `VAR=value` words, then the targets.
- a link: `[text](target)` outside code, not a URL with a scheme; its file must exist and
  its `#anchor`, if any, must be a heading of that file (GitHub's slugs).
- a metric: any word `natgw_...` anywhere; it must be a name the agent exports, with the
  suffixes Prometheus adds (`_total` of a counter, `_bucket`/`_sum`/`_count` of a histogram).
- an Event reason: `reason=Name` anywhere; a code span `Name` followed by `Event`,
  `Warning Event` or `Normal Event`; or the first cell of a row in a table whose first
  header cell is `Event reason`.
"""
from __future__ import annotations

import argparse
import ast
import re
import time
from pathlib import Path
from typing import Iterator

import pytest

from tests.builders import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMANDS = ("natgw-agent", "natgw-supervise")


# --- reading markdown ------------------------------------------------------------------------

FENCE = re.compile(r"^```.*?^```[ \t]*$", re.M | re.S)
SPAN = re.compile(r"`([^`]+)`")


def split_code(text: str) -> tuple[str, list[str]]:
    """(the prose with fenced blocks blanked, the fenced blocks' lines)."""
    lines = [line for block in FENCE.findall(text) for line in block.splitlines()[1:-1]]
    return FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text), lines


def code_snippets(text: str) -> list[str]:
    """Every inline code span (its line breaks as spaces) and every fenced line."""
    prose, lines = split_code(text)
    return [" ".join(s.split()) for s in SPAN.findall(prose)] + lines


# --- commands and flags ----------------------------------------------------------------------

def agent_parser() -> argparse.ArgumentParser:
    from agent.cli import _parser

    return _parser()


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return {name: sub for action in parser._actions if isinstance(action, argparse._SubParsersAction)
            for name, sub in action.choices.items()}


def every_option() -> set[str]:
    """The option strings of natgw-agent's parser and every subcommand's."""
    top = agent_parser()
    return {o for p in (top, *subcommands(top).values()) for a in p._actions for o in a.option_strings}


PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_.:/-]*$|<|\.\.\.")
END = {"|", ";", "&&", "||"}


def command_lines(snippet: str) -> Iterator[tuple[str, list[str]]]:
    """(command, its arguments) for each natgw-agent/natgw-supervise command line in it."""
    words = snippet.split()
    for n, word in enumerate(words):
        if word not in COMMANDS:
            continue
        before = words[:n]
        if before[-1:] != ["--"] and not all(w in ("$", "sudo") or re.fullmatch(r"[A-Z_]+=\S*", w) for w in before):
            continue
        args = []
        for w in words[n + 1:]:
            if w in END or w.startswith("#"):
                break
            args.append(w)
        yield word, args


def argument_problems(args: list[str], parser: argparse.ArgumentParser | None = None) -> list[str]:
    """What in `natgw-agent ARGS` its parsers would not know."""
    parser = parser or agent_parser()
    subs = subcommands(parser)
    i = 0
    while i < len(args):
        word = args[i]
        if PLACEHOLDER.search(word):
            i += 1
        elif word.startswith("-"):
            option = word.split("=", 1)[0]
            action = parser._option_string_actions.get(option)
            if action is None:
                return [f"`{parser.prog}` has no option {option}"]
            i += 2 if action.nargs != 0 and "=" not in word else 1
        elif subs:
            if word not in subs:
                return [f"`{parser.prog}` has no subcommand {word!r}"]
            if word == "supervise":  # the rest is the worker's
                rest = args[i + 1:]
                return [] if rest[:1] in (["-h"], ["--help"]) else argument_problems(rest)
            parser, subs = subs[word], {}
            i += 1
        else:
            i += 1  # a positional value
    return []


def command_problems(text: str) -> list[str]:
    found = []
    options = every_option()
    for snippet in code_snippets(text):
        for command, args in command_lines(snippet):
            worker = command == "natgw-supervise"
            if worker and args[:1] in (["-h"], ["--help"]):
                continue
            found += [f"{snippet!r}: {p}" for p in argument_problems(args)]
        if snippet.startswith("--"):
            flag = snippet.split()[0].split("=", 1)[0]
            known = any(o.startswith(flag[:-1]) for o in options) if flag.endswith("*") else flag in options
            if not known:
                found.append(f"{snippet!r}: natgw-agent has no option {flag}")
    return found


def mentioned_commands(text: str) -> list[str]:
    return [snippet for snippet in code_snippets(text) for _ in command_lines(snippet)]


# --- make targets ----------------------------------------------------------------------------

def make_targets() -> set[str]:
    """Every target a line of the Makefile defines (`a b: deps`, not `A := value`)."""
    found = set()
    for line in (ROOT / "Makefile").read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.-]+(?:[ \t]+[A-Za-z0-9_.-]+)*)[ \t]*:(?!=)", line)
        if m:
            found |= set(m.group(1).split()) - {".PHONY"}
    return found


def make_mentions(text: str) -> list[str]:
    found = []
    for snippet in code_snippets(text):
        words = snippet.split("#")[0].split()
        for n, word in enumerate(words):
            if word != "make" or (n and not re.fullmatch(r"[A-Z_]+=\S*|\$|sudo|;|&&", words[n - 1])):
                continue
            for w in words[n + 1:]:
                if re.fullmatch(r"[A-Z_]+=\S*", w):
                    continue
                if not re.fullmatch(r"[a-z][a-z0-9-]*", w):
                    break
                found.append(w)
    return found


def make_problems(text: str) -> list[str]:
    targets = make_targets()
    return [f"`make {t}`: no such target in the Makefile" for t in make_mentions(text) if t not in targets]


# --- links -----------------------------------------------------------------------------------

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as dashes."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    prose, _ = split_code(path.read_text())
    seen: dict[str, int] = {}
    found = set()
    for m in re.finditer(r"^#{1,6} +(.+?) *#*$", prose, re.M):
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def link_problems(text: str, at: Path) -> list[str]:
    """Relative links of a file at `at` that lead nowhere."""
    prose, _ = split_code(text)
    prose = SPAN.sub("", prose)
    found = []
    for target in LINK.findall(prose):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):
            continue  # a URL
        name, _, anchor = target.partition("#")
        path = (at.parent / name).resolve() if name else at
        if not path.exists():
            found.append(f"{target}: no file {path}")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            found.append(f"{target}: no heading #{anchor} in {path.name}")
    return found


# --- metrics ---------------------------------------------------------------------------------

def exported_metrics() -> set[str]:
    """The names a scrape of the agent shows, per-backend counters included, with the
    suffixes Prometheus gives each kind (a labelled histogram has no sample before it
    observes one: its TYPE line names it)."""
    from agent.ops.metrics import Metrics

    metrics = Metrics()
    metrics.serve_backend_counters(lambda: {("172.18.0.10:80/tcp", "10.0.1.11:8080"): (1, 60)}, interval=0)
    deadline = time.monotonic() + 5
    while b"natgw_backend_packets" not in metrics.exposition() and time.monotonic() < deadline:
        time.sleep(0.01)
    names = set()
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ()}
    for line in metrics.exposition().decode().splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            base = name.removesuffix("_total") if kind == "counter" else name
            names |= {base, *(base + s for s in suffixes.get(kind, ()))}
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


METRIC = re.compile(r"\bnatgw_[a-z_]+")


def metric_problems(text: str, exported: set[str]) -> list[str]:
    return [f"{name}: the agent exports no such metric" for name in METRIC.findall(text) if name not in exported]


# --- Event reasons ---------------------------------------------------------------------------

def recorded_reasons() -> tuple[set[str], list[str]]:
    """(the reasons of every Event the agent records, the calls whose reason is not literal).
    An Event is recorded by `<recorder>.warning(kind, name, uid, reason, message, ...)`
    (agent/sources/events.py's EventRecorder and the protocols standing for it), or with
    `reason=` beside `message=`; a log call has one positional argument and no message."""
    reasons: set[str] = set()
    unclear: list[str] = []
    for path in sorted((ROOT / "agent").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "warning"):
                continue
            keywords = {k.arg: k.value for k in node.keywords}
            reason = node.args[3] if len(node.args) >= 4 else keywords.get("reason") if "message" in keywords else None
            if reason is None:
                continue
            todo = [reason]
            while todo:
                expr = todo.pop()
                if isinstance(expr, ast.IfExp):
                    todo += [expr.body, expr.orelse]
                elif isinstance(expr, ast.Constant) and isinstance(expr.value, str):
                    reasons.add(expr.value)
                else:
                    unclear.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return reasons, unclear


CAMEL = r"[A-Z][a-z]+(?:[A-Z][a-z]+)+"


def reason_mentions(text: str) -> list[str]:
    found = re.findall(rf"reason=({CAMEL}|\w+)", text)
    found += re.findall(rf"`({CAMEL})`\s+(?:(?:Warning|Normal)\s+)?Events?\b", text)
    header = None
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.lstrip().startswith("|") else None
        if cells is None:
            header = None
        elif header is None:
            header = cells[0]
        elif header == "Event reason" and not set(cells[0]) <= set("-: "):
            found.append(cells[0].strip("`"))
    return found


def reason_problems(text: str, reasons: set[str]) -> list[str]:
    return [f"{r}: the agent records no Event with this reason" for r in reason_mentions(text) if r not in reasons]


# --- the docs as they are --------------------------------------------------------------------

def doc_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_every_command_line_and_flag_the_docs_show_exists(doc):
    assert command_problems(doc.read_text()) == []


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_every_make_target_the_docs_name_exists(doc):
    assert make_problems(doc.read_text()) == []


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_every_relative_link_resolves(doc):
    assert link_problems(doc.read_text(), doc) == []


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_every_metric_the_docs_name_is_exported(doc, metric_names):
    assert metric_problems(doc.read_text(), metric_names) == []


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_every_event_reason_the_docs_name_is_recorded(doc):
    reasons, _ = recorded_reasons()
    assert reason_problems(doc.read_text(), reasons) == []


def test_the_checks_find_what_they_look_for():
    """Not vacuous: the docs do mention each kind, and the truths are gathered."""
    text = "\n".join(d.read_text() for d in DOCS)
    reasons, unclear = recorded_reasons()
    assert unclear == [], "an Event whose reason is no literal: the docs' check cannot see it"
    assert len(mentioned_commands(text)) > 20 and {"test", "run", "bench"} <= set(make_mentions(text))
    assert len(LINK.findall(text)) > 20 and len(METRIC.findall(text)) > 20
    assert set(reason_mentions(text)) == reasons  # every reason the agent records is documented


def test_the_readme_starts_with_the_two_commands_and_stays_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    top = "\n".join(lines[:20])
    assert "make run" in top and "make test" in top
    assert len(lines) <= 150


@pytest.fixture(scope="module")
def metric_names():
    return exported_metrics()


# --- the twins: each check fails on a wrong snippet ------------------------------------------

def test_the_command_check_catches_an_unknown_flag_subcommand_or_lone_flag():
    assert command_problems("`natgw-agent show --identity 172.18.0.10:80/tcp --json`") == []
    assert command_problems("```\n$ natgw-agent --log-format json run --gateway gw1 # it runs\n```") == []
    assert command_problems("`kubectl exec <pod> -c natgw-agent -- natgw-agent health --routable`") == []
    assert command_problems("`natgw-supervise --log-format json run --take-over-legacy`, `--health-*`") == []
    assert command_problems("`natgw-agent show --no-such-flag`") == ["'natgw-agent show --no-such-flag': "
                                                                     "`natgw-agent show` has no option --no-such-flag"]
    assert command_problems("`natgw-agent frobnicate`") != []
    assert command_problems("`natgw-agent run --identity 1.2.3.4:80/tcp`") != []  # show's, not run's
    assert command_problems("`natgw-agent supervise run --bogus`") != []
    assert command_problems("```\nnatgw-supervise --log-format json sync\n```") != []
    assert command_problems("`--hairpin-snatt`") != [] and command_problems("`--nope-*`") != []


def test_the_make_check_catches_an_unknown_target():
    assert make_problems("`make test`, `UPDATE_GOLDEN=1 make test`, `make\nbench`") == []
    assert make_problems("```\nmake run    # the demo\n```") == []
    assert make_problems("`make tests`") == ["`make tests`: no such target in the Makefile"]
    assert make_problems("```\nmake IMAGE=x image-push\n```") != []


def test_the_link_check_catches_a_dead_link_or_anchor():
    at = ROOT / "docs" / "README.md"
    assert link_problems("[ops](operating.md#reading-show-and-diff), [top](../README.md), [w](https://x/y)", at) == []
    assert link_problems("[gone](nowhere.md)", at) != []
    assert link_problems("[gone](operating.md#no-such-heading)", at) != []
    assert link_problems("[gone](../BENCHMARKS.md#no-such-section)", at) != []
    assert link_problems("`[not a link](nowhere.md)`", at) == []  # code is not a link


def test_the_metric_check_catches_an_unknown_metric(metric_names):
    assert metric_problems("`natgw_sync_failures_total`, `natgw_sync_duration_seconds_bucket`, "
                           "`natgw_backend_packets_total{identity,backend}`", metric_names) == []
    assert metric_problems("`natgw_sync_failure_total`", metric_names) == [
        "natgw_sync_failure_total: the agent exports no such metric"]
    assert metric_problems("rate(natgw_backend_connections_total[5m])", metric_names) != []


def test_the_event_check_catches_an_unknown_reason():
    reasons, _ = recorded_reasons()
    good = ("an `InvalidRule` Warning Event; `kubectl get events --field-selector reason=ApplyFailed`\n\n"
            "| Event reason | type |\n| --- | --- |\n| `BackendUp` | Normal |\n")
    assert reason_problems(good, reasons) == []
    assert reason_problems("records a `BackendGone` Warning Event", reasons) == [
        "BackendGone: the agent records no Event with this reason"]
    assert reason_problems("`--field-selector reason=InvalidRules`", reasons) != []
    assert reason_problems("| Event reason | type |\n| --- | --- |\n| `CrdMissing` | Warning |\n", reasons) != []
    assert reason_problems("the `VpcNatGateway` object", reasons) == []  # not said as an Event's reason
