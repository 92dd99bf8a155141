"""The phase report of a run's summary (issue 14): what happened, and a warning for what did not."""

from async_rl.run_summary import phase_report


def _rows(n, **metrics):
    return [dict(metrics, **{"trainer/step": float(i + 1)}) for i in range(n)]


def test_a_run_that_learned_nothing_says_so():
    history = _rows(3, **{"train/reward_mean": 0.0, "actor/updated": 0.0, "train/num_turns/mean": 1.0,
                          "train/tool_calls": 0.0, "critic/value_loss": 0.1})
    report = phase_report(history, "lisao", "retool")
    phases = report["phases"]
    assert not phases["reward"]["ran"] and not phases["actor_updates"]["ran"]
    assert not phases["multi_turn"]["ran"] and not phases["tool_calls"]["ran"]
    assert phases["critic_updates"] == {"ran": True, "steps": 3}
    text = "\n".join(report["warnings"])
    for name in ("reward", "actor_updates", "multi_turn", "tool_calls"):
        assert f"'{name}'" in text
    assert "critic_updates" not in text


def test_li2sao_switch_forced_is_a_warning_and_evidence_is_not():
    history = _rows(2, **{"train/reward_mean": 0.5, "actor/updated": 1.0, "critic/value_loss": 0.1})
    forced = phase_report(history, "li2sao", "math", switch_step=2, switch_forced=True)
    assert forced["phases"]["li2sao_switch"] == {"ran": True, "step": 2, "gate_opened_on_evidence": False}
    assert any("forced at T_max" in w for w in forced["warnings"])
    opened = phase_report(history, "li2sao", "math", switch_step=2, switch_forced=False)
    assert opened["warnings"] == [] and opened["phases"]["li2sao_switch"]["gate_opened_on_evidence"] is True
    never = phase_report(history, "li2sao", "math")
    assert any("'li2sao_switch'" in w for w in never["warnings"])
    assert "multi_turn" not in never["phases"]  # math is single-turn


def test_sapo_needs_both_value_losses_and_counts_tool_calls():
    history = _rows(2, **{"train/reward_mean": 1.0, "actor/updated": 1.0, "sapo/v_loss": 0.1,
                          "train/num_turns/mean": 2.5})
    report = phase_report(history, "sapo", "alfworld")
    assert not report["phases"]["sapo_value_losses"]["ran"]  # no sapo/q_loss logged
    history[1]["sapo/q_loss"] = 0.2
    history[0]["sapo/q_loss"] = 0.2
    report = phase_report(history, "sapo", "alfworld")
    assert report["phases"]["sapo_value_losses"] == {"ran": True, "steps": 2}
    assert report["phases"]["multi_turn"]["ran"] and report["warnings"] == []
    calls = phase_report(_rows(3, **{"train/tool_calls": 2.0}), "grpo", "retool")["phases"]["tool_calls"]
    assert calls == {"ran": True, "count": 6}
