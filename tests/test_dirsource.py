"""DirectorySource: a directory of YAML/JSON manifests, polled by stat signature.

No sleeps: every rewrite moves the file's mtime forward explicitly, so a change is always
visible to the stat check whatever the filesystem's timestamp granularity."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from agent.sources.directory import DirectorySource
from agent.core.model import manifest
from tests.oracles import as_dict, build_inventory

ROOT = Path(__file__).resolve().parent.parent


def write(path: Path, text: str | bytes) -> Path:
    """Write a file; when it already existed, move its mtime a second forward."""
    old = path.stat().st_mtime_ns if path.exists() else None
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    if old is not None:
        os.utime(path, ns=(old + 10**9, old + 10**9))
    return path


def objects(source: DirectorySource) -> list[Any]:
    """The source's objects as the dicts they stand for (it keeps them compact)."""
    return [as_dict(o) for o in source.objects()]


def poll(source: DirectorySource) -> bool:
    """Poll twice: a changed file is read once it has held still for one poll."""
    first = source.poll()
    return source.poll() or first


def names(source: DirectorySource) -> list[str]:
    return [o["metadata"]["name"] for o in objects(source)]


def rule_yaml(name: str, port: str = "80", backend: str = "10.0.1.11") -> str:
    return f"""\
apiVersion: kubeovn.io/v1
kind: IptablesDnatRule
metadata:
  name: {name}
spec:
  eip: eip-web
  externalPort: '{port}'
  protocol: tcp
  internalIp: {backend}
  internalPort: '8080'
  type: share
"""


EIP_YAML = """\
apiVersion: kubeovn.io/v1
kind: IptablesEIP
metadata:
  name: eip-web
spec: {v4ip: 172.18.0.10, natGwDp: gw1}
status: {ip: 172.18.0.10}
"""


def loaded(directory: Path) -> DirectorySource:
    source = DirectorySource(directory)
    assert poll(source) is True
    return source


# --------------------------------------------------------------------------- file formats

def test_one_object_per_file(tmp_path: Path) -> None:
    write(tmp_path / "eip.yaml", EIP_YAML)
    write(tmp_path / "web-a.yaml", rule_yaml("web-a"))
    write(tmp_path / "web-b.yml", rule_yaml("web-b"))
    source = loaded(tmp_path)
    assert sorted(names(source)) == ["eip-web", "web-a", "web-b"]
    web_a = next(o for o in objects(source) if o["metadata"]["name"] == "web-a")
    assert web_a["kind"] == "IptablesDnatRule"
    assert web_a["spec"] == {"eip": "eip-web", "externalPort": "80", "protocol": "tcp", "internalIp": "10.0.1.11",
                             "internalPort": "8080", "type": "share"}


def test_several_yaml_documents_in_one_file(tmp_path: Path) -> None:
    write(tmp_path / "all.yaml", "---\n".join([EIP_YAML, rule_yaml("web-a"), rule_yaml("web-b")]))
    source = loaded(tmp_path)
    assert names(source) == ["eip-web", "web-a", "web-b"]


def test_kind_list_items_are_taken_as_they_are(tmp_path: Path) -> None:
    write(tmp_path / "list.yaml", """\
apiVersion: v1
kind: List
items:
- apiVersion: kubeovn.io/v1
  kind: IptablesEIP
  metadata: {name: eip-web}
- apiVersion: kubeovn.io/v1
  kind: IptablesDnatRule
  metadata: {name: web-a}
- metadata: {name: no-kind}
- just a string
""")
    source = loaded(tmp_path)
    assert [(o.get("kind"), o["metadata"]["name"]) for o in objects(source)] == [
        ("IptablesEIP", "eip-web"),
        ("IptablesDnatRule", "web-a"),
    ]  # a generic List does not say what its items are: no-kind gets none, so the model has no use for it
    assert all(o.get("kind") != "List" for o in objects(source))


def test_api_list_gives_its_items_their_kind(tmp_path: Path) -> None:
    # `kubectl get iptables-dnat-rules -o json` through the raw API: items may lack kind.
    write(tmp_path / "rules.json", json.dumps({
        "apiVersion": "kubeovn.io/v1",
        "kind": "IptablesDnatRuleList",
        "metadata": {"resourceVersion": "48300"},
        "items": [
            {"metadata": {"name": "web-a"}, "spec": {"type": "share"}},
            {"apiVersion": "kubeovn.io/v1", "metadata": {"name": "web-b"}},
            {"kind": "IptablesDnatRule", "metadata": {"name": "web-c"}},
        ],
    }))
    source = loaded(tmp_path)
    assert [(o["kind"], o["metadata"]["name"]) for o in objects(source)] == [
        ("IptablesDnatRule", "web-a"),
        ("IptablesDnatRule", "web-b"),
        ("IptablesDnatRule", "web-c"),
    ]
    assert objects(source)[0]["spec"] == {"type": "share"}


def test_api_list_in_yaml_and_its_items_reach_the_model(tmp_path: Path) -> None:
    write(tmp_path / "eips.yaml", """\
apiVersion: kubeovn.io/v1
kind: IptablesEIPList
items:
- metadata: {name: eip-web}
  spec: {v4ip: 172.18.0.10, natGwDp: gw1}
""")
    write(tmp_path / "rules.yaml", """\
apiVersion: kubeovn.io/v1
kind: IptablesDnatRuleList
items:
- metadata: {name: web-a}
  spec: {eip: eip-web, externalPort: '80', protocol: tcp, internalIp: 10.0.1.11, internalPort: '8080', type: share}
""")
    source = loaded(tmp_path)
    inv = build_inventory(source.objects(), "gw1")
    assert inv.errors == ()
    assert [(r.name, str(r.identity), str(r.backend)) for r in inv.rules] == [
        ("web-a", "172.18.0.10:80/tcp", "10.0.1.11:8080")
    ]


def test_json_file_with_one_object(tmp_path: Path) -> None:
    obj = {"apiVersion": "kubeovn.io/v1", "kind": "IptablesDnatRule", "metadata": {"name": "dns-a"},
           "spec": {"eip": "eip-web", "externalPort": "53", "protocol": "UDP", "internalIp": "10.0.1.11",
                    "internalPort": "5353", "type": "share"}}
    write(tmp_path / "dns.json", json.dumps(obj, indent=1))
    source = loaded(tmp_path)
    assert source.objects() == [manifest(obj)]  # kept as the model reads it
    assert objects(source)[0] == {k: v for k, v in obj.items() if k != "apiVersion"}


def test_non_manifest_files_are_ignored(tmp_path: Path) -> None:
    write(tmp_path / "web.yaml", rule_yaml("web-a"))
    write(tmp_path / "notes.txt", rule_yaml("from-txt"))
    write(tmp_path / "web.yaml.bak", rule_yaml("from-bak"))
    write(tmp_path / "web.yaml~", rule_yaml("from-tilde"))
    write(tmp_path / ".web.yaml.swp", rule_yaml("from-swap"))
    write(tmp_path / ".hidden.yaml", rule_yaml("from-dotfile"))
    write(tmp_path / ".hidden.json", "{not json at all")
    (tmp_path / "subdir.yaml").mkdir()
    write(tmp_path / "subdir.yaml" / "inner.yaml", rule_yaml("from-subdir"))
    source = loaded(tmp_path)
    assert names(source) == ["web-a"]
    # Editing ignored files changes nothing.
    write(tmp_path / ".web.yaml.swp", "garbage: [")
    write(tmp_path / "notes.txt", rule_yaml("other"))
    assert poll(source) is False
    assert names(source) == ["web-a"]


def test_empty_and_non_object_documents_are_ignored(tmp_path: Path) -> None:
    write(tmp_path / "a-empty-doc.yaml", "---\n")
    write(tmp_path / "b-empty-docs.yaml", "---\n---\n---\n")
    write(tmp_path / "c-comment-only.yaml", "# nothing here yet\n")
    write(tmp_path / "d-empty-file.yaml", "")
    write(tmp_path / "e-mixed.yaml", "---\n" + rule_yaml("web-a") + "---\n---\njust a string\n---\n- a\n- list\n---\n"
          + rule_yaml("web-b") + "---\n")
    source = DirectorySource(tmp_path)
    poll(source)
    assert names(source) == ["web-a", "web-b"]


def test_objects_are_ordered_by_file_name(tmp_path: Path) -> None:
    write(tmp_path / "b.yaml", rule_yaml("from-b"))
    write(tmp_path / "a.json", json.dumps({"kind": "IptablesDnatRule", "metadata": {"name": "from-a"}}))
    write(tmp_path / "c.yml", rule_yaml("from-c"))
    assert names(loaded(tmp_path)) == ["from-a", "from-b", "from-c"]


def test_examples_directory_gives_the_documented_rules() -> None:
    source = loaded(ROOT / "examples")
    inv = build_inventory(source.objects(), "gw1")
    assert inv.errors == ()
    assert sorted(r.name for r in inv.rules) == [
        "app-443-a", "app-443-b", "app-443-c",
        "dns-53-a", "dns-53-b", "dns-53-c",
        "web-80-a", "web-80-b", "web-80-c",
    ]
    assert "other-gw-80" in names(source)  # present in the files, but another gateway's


# --------------------------------------------------------------------------- polling

def test_poll_reports_first_load_no_change_edit_and_removal(tmp_path: Path) -> None:
    a = write(tmp_path / "a.yaml", rule_yaml("web-a"))
    write(tmp_path / "b.yaml", rule_yaml("web-b"))
    source = DirectorySource(tmp_path)
    assert objects(source) == []  # nothing before the first poll

    assert poll(source) is True
    assert names(source) == ["web-a", "web-b"]

    assert poll(source) is False
    assert poll(source) is False
    assert names(source) == ["web-a", "web-b"]

    write(a, rule_yaml("web-a", port="8000"))  # longer content and a later mtime
    assert poll(source) is True
    assert objects(source)[0]["spec"]["externalPort"] == "8000"
    assert poll(source) is False

    write(a, rule_yaml("web-a", port="8001"))  # same size: only the mtime tells
    assert poll(source) is True
    assert objects(source)[0]["spec"]["externalPort"] == "8001"

    (tmp_path / "b.yaml").unlink()
    assert poll(source) is True
    assert names(source) == ["web-a"]
    assert poll(source) is False


def test_touch_without_content_change_is_not_a_change(tmp_path: Path) -> None:
    a = write(tmp_path / "a.yaml", rule_yaml("web-a"))
    source = loaded(tmp_path)
    write(a, rule_yaml("web-a"))  # same content, new mtime
    assert poll(source) is False
    write(a, "# a comment now\n" + rule_yaml("web-a"))  # same objects, different text
    assert poll(source) is False
    assert names(source) == ["web-a"]


def test_new_file_is_picked_up(tmp_path: Path) -> None:
    write(tmp_path / "a.yaml", rule_yaml("web-a"))
    source = loaded(tmp_path)
    write(tmp_path / "b.yaml", rule_yaml("web-b"))
    assert poll(source) is True
    assert names(source) == ["web-a", "web-b"]


def test_atomic_replace_by_rename_is_seen(tmp_path: Path) -> None:
    # Editors and `kubectl get > tmp && mv tmp a.yaml` replace the file: a new inode.
    a = write(tmp_path / "a.yaml", rule_yaml("web-a", port="80"))
    source = loaded(tmp_path)
    tmp = write(tmp_path / "a.yaml.tmp", rule_yaml("web-a", port="81"))
    st = a.stat()
    os.utime(tmp, ns=(st.st_atime_ns, st.st_mtime_ns))  # even with the very same mtime and size
    os.replace(tmp, a)
    assert poll(source) is True
    assert objects(source)[0]["spec"]["externalPort"] == "81"


def test_removing_every_file_withdraws_everything(tmp_path: Path) -> None:
    write(tmp_path / "a.yaml", rule_yaml("web-a"))
    write(tmp_path / "b.json", json.dumps({"kind": "IptablesEIP", "metadata": {"name": "eip-web"}}))
    source = loaded(tmp_path)
    for path in tmp_path.iterdir():
        path.unlink()
    assert poll(source) is True
    assert objects(source) == []


# --------------------------------------------------------------------------- unparseable files

def test_unparseable_file_keeps_its_last_good_objects(tmp_path: Path) -> None:
    a = write(tmp_path / "a.yaml", rule_yaml("web-a", port="80"))
    b = write(tmp_path / "b.yaml", rule_yaml("web-b", port="80"))
    source = loaded(tmp_path)
    before = objects(source)

    write(a, "kind: IptablesDnatRule\nmetadata: {name: web-a\nspec: [\n")  # half-written save
    assert poll(source) is False
    assert objects(source) == before
    assert poll(source) is False  # still broken, still unchanged, not re-reported as a change

    # Other files' edits still apply while a.yaml stays broken.
    write(b, rule_yaml("web-b", port="90"))
    assert poll(source) is True
    assert [o["spec"]["externalPort"] for o in objects(source)] == ["80", "90"]
    write(tmp_path / "c.yaml", rule_yaml("web-c"))
    assert poll(source) is True
    assert names(source) == ["web-a", "web-b", "web-c"]

    # Fixed: the new content is used.
    write(a, rule_yaml("web-a", port="8080"))
    assert poll(source) is True
    assert [o["spec"]["externalPort"] for o in objects(source)] == ["8080", "90", "80"]


def test_unparseable_file_fixed_back_to_its_old_content_is_no_change(tmp_path: Path) -> None:
    a = write(tmp_path / "a.yaml", rule_yaml("web-a"))
    source = loaded(tmp_path)
    write(a, "{{{{")
    assert poll(source) is False
    write(a, rule_yaml("web-a"))
    assert poll(source) is False
    assert names(source) == ["web-a"]


def test_broken_later_document_keeps_the_whole_file(tmp_path: Path) -> None:
    a = write(tmp_path / "a.yaml", rule_yaml("web-a") + "---\n" + rule_yaml("web-b"))
    source = loaded(tmp_path)
    write(a, rule_yaml("web-a", port="81") + "---\nkind: [unclosed\n")
    assert poll(source) is False
    assert [(o["metadata"]["name"], o["spec"]["externalPort"]) for o in objects(source)] == [
        ("web-a", "80"), ("web-b", "80")
    ]


def test_unparseable_json_keeps_its_last_good_objects(tmp_path: Path) -> None:
    obj: dict[str, Any] = {"kind": "IptablesDnatRule", "metadata": {"name": "dns-a"}}
    a = write(tmp_path / "a.json", json.dumps(obj))
    source = loaded(tmp_path)
    write(a, json.dumps(obj)[:-5])  # truncated
    assert poll(source) is False
    assert source.objects() == [manifest(obj)]
    write(a, json.dumps({**obj, "metadata": {"name": "dns-b"}}))
    assert poll(source) is True
    assert names(source) == ["dns-b"]


def test_invalid_utf8_keeps_its_last_good_objects(tmp_path: Path) -> None:
    a = write(tmp_path / "a.yaml", rule_yaml("web-a"))
    source = loaded(tmp_path)
    write(a, b"kind: IptablesDnatRule\nmetadata: {name: \xff\xfe}\n")
    assert poll(source) is False
    assert names(source) == ["web-a"]


def test_file_unparseable_from_the_start_gives_nothing_until_fixed(tmp_path: Path) -> None:
    write(tmp_path / "a.yaml", rule_yaml("web-a"))
    b = write(tmp_path / "b.yaml", "metadata: [\n")
    source = DirectorySource(tmp_path)
    assert poll(source) is True  # a.yaml loaded
    assert names(source) == ["web-a"]
    write(b, rule_yaml("web-b"))
    assert poll(source) is True
    assert names(source) == ["web-a", "web-b"]


def test_removing_an_unparseable_file_withdraws_its_last_good_objects(tmp_path: Path) -> None:
    a = write(tmp_path / "a.yaml", rule_yaml("web-a"))
    write(tmp_path / "b.yaml", rule_yaml("web-b"))
    source = loaded(tmp_path)
    write(a, "spec: [\n")
    assert poll(source) is False
    a.unlink()
    assert poll(source) is True
    assert names(source) == ["web-b"]


# --------------------------------------------------------------------------- the directory itself

def test_missing_directory_does_not_raise(tmp_path: Path) -> None:
    source = DirectorySource(tmp_path / "does-not-exist")
    assert poll(source) is False
    assert objects(source) == []
    assert poll(source) is False


def test_directory_that_is_a_file_does_not_raise(tmp_path: Path) -> None:
    path = write(tmp_path / "rules.yaml", rule_yaml("web-a"))
    source = DirectorySource(path)
    assert poll(source) is False
    assert objects(source) == []


def test_directory_created_later_is_loaded(tmp_path: Path) -> None:
    directory = tmp_path / "rules"
    source = DirectorySource(directory)
    assert poll(source) is False
    directory.mkdir()
    write(directory / "a.yaml", rule_yaml("web-a"))
    assert poll(source) is True
    assert names(source) == ["web-a"]


def test_directory_vanishing_keeps_serving_what_it_had(tmp_path: Path) -> None:
    directory = tmp_path / "rules"
    directory.mkdir()
    a = write(directory / "a.yaml", rule_yaml("web-a"))
    source = loaded(directory)
    a.unlink()
    directory.rmdir()
    assert poll(source) is False
    assert names(source) == ["web-a"]


def test_accepts_a_string_path(tmp_path: Path) -> None:
    write(tmp_path / "a.yaml", rule_yaml("web-a"))
    source = DirectorySource(str(tmp_path))  # type: ignore[arg-type]
    assert poll(source) is True
    assert names(source) == ["web-a"]


def test_a_changing_file_is_read_only_once_it_holds_still(tmp_path: Path) -> None:
    rules = tmp_path / "rules"
    rules.mkdir()
    write(rules / "eip.yaml", EIP_YAML)
    write(rules / "web.yaml", rule_yaml("web-a"))
    source = DirectorySource(rules)
    assert source.poll() is True  # the first poll reads everything at once
    write(rules / "web.yaml", "")  # an editor truncates before writing
    assert source.poll() is False and "web-a" in names(source)
    write(rules / "web.yaml", rule_yaml("web-b"))  # ... and writes the new content
    assert source.poll() is False and "web-a" in names(source)
    assert source.poll() is True and "web-b" in names(source) and "web-a" not in names(source)


def test_not_ready_until_the_directory_could_be_read(tmp_path: Path) -> None:
    # Before the first successful read, "no objects" means "unknown": the agent must not
    # wipe the kernel because its directory is not mounted yet.
    rules = tmp_path / "rules"
    source = DirectorySource(rules)
    assert source.poll() is False and not source.ready
    rules.mkdir()
    assert source.poll() is False and source.ready  # an empty directory is a real "no rules"


def test_one_edited_rule_in_a_big_file_is_one_change(tmp_path: Path) -> None:
    rules = tmp_path / "rules"
    rules.mkdir()
    write(rules / "eip.yaml", EIP_YAML)
    many = [rule_yaml(f"web-{i}", str(1000 + i)) for i in range(200)]
    write(rules / "web.yaml", "---\n".join(many))
    source = DirectorySource(rules)
    assert source.poll() is True and source.take_changes() is None  # first: everything
    many[57] = rule_yaml("web-57", "1057", backend="10.0.1.99")
    write(rules / "web.yaml", "---\n".join(many))
    assert poll(source) is True
    assert source.take_changes() == {("IptablesDnatRule", "web-57")}
    assert as_dict(source.named("IptablesDnatRule", "web-57")[0])["spec"]["internalIp"] == "10.0.1.99"
    write(rules / "web.yaml", "---\n".join(many[:100]))
    poll(source)
    assert source.take_changes() == {("IptablesDnatRule", f"web-{i}") for i in range(100, 200)}
    assert source.named("IptablesDnatRule", "web-150") == []


# ---- followed through inotify once started

def test_a_closed_file_is_read_at_once_and_one_still_open_once_it_holds_still(tmp_path: Path) -> None:
    import select as _select

    source = DirectorySource(tmp_path, poll_interval=0.05)
    source.start()
    try:
        assert source.fileno() is not None and source.next_poll() is None  # nothing to poll for
        source.poll()
        write(tmp_path / "a.yaml", rule_yaml("web-a"))  # written and closed
        assert _select.select([source.fileno()], [], [], 2)[0]  # the descriptor says so
        assert source.poll() and names(source) == ["web-a"]  # read at once, no settle
        with open(tmp_path / "b.yaml", "w") as f:  # written in place, still open
            f.write(rule_yaml("web-b"))
            f.flush()
            assert not source.poll() and source.next_poll() is not None  # waits to hold still
        time.sleep(0.06)
        assert source.poll() and names(source) == ["web-a", "web-b"]  # (closed now: at once)
    finally:
        source.stop()


def test_a_removed_directory_falls_back_to_polling(tmp_path: Path) -> None:
    rules = tmp_path / "rules"
    rules.mkdir()
    source = DirectorySource(rules, poll_interval=0.05)
    source.start()
    try:
        source.poll()
        rules.rmdir()
        source.poll()
        assert source.fileno() is None and source.next_poll() is not None  # polled from now on
        rules.mkdir()
        write(rules / "a.yaml", rule_yaml("web-a"))
        assert not source.poll()  # seen changing: read once it holds still
        assert source.poll() and names(source) == ["web-a"]
    finally:
        source.stop()


def test_without_inotify_it_polls(tmp_path: Path, monkeypatch: Any) -> None:
    import agent.sources.directory as dirsource

    def refuse(_: str) -> None:
        raise OSError(38, "no inotify here")

    monkeypatch.setattr(dirsource, "Inotify", refuse)
    source = DirectorySource(tmp_path / "absent", poll_interval=0.05)
    source.start()
    assert source.fileno() is None and source.next_poll() is not None
