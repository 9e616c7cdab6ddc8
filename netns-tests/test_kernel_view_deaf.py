"""KernelView.deaf against the real kernel: while the agent's own large transaction runs
the view hears nothing (the kernel builds no notifications); another's commit in that
window is known of (a full read-back follows); afterwards it listens again."""
from __future__ import annotations

from gwtest import report_of, script_in_fresh_namespace


def test_the_view_is_deaf_only_while_the_agent_commits_and_knows_what_it_missed() -> None:
    report = report_of(script_in_fresh_namespace("ngwdeaf", "deaf_view.py", timeout=60))
    assert report == {"quiet_nothing_queued": True, "quiet_is_none": True, "others_everything": True,
                      "other_table_everything": True, "after_heard": True}, report
