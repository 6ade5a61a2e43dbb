"""The one definition of staleness: hand-computed values, windows, errors."""

from __future__ import annotations

import pytest

from stalepipe.config import ConfigError, DelayConfig, TrainConfig
from stalepipe.training.delay import DELAY_POLICIES, DelaySchedule, resolve_delay_config
from stalepipe.training.delay.policies import cooldown_steps, wpipe_group


def sched(policy: str, P: int, T: int, sync_start: int = 0, sync_cooldown: float = 0.0):
    if not (sync_start or sync_cooldown):  # a bare name: the policy's own error messages
        return DelaySchedule.build(policy, P, T)
    return DelaySchedule.build(
        DelayConfig(policy=policy, sync_start=sync_start, sync_cooldown=sync_cooldown), P, T
    )


def staleness(policy, stage, step, P, T, **kw) -> int:
    return sched(policy, P, T, **kw).tau(stage, step)


def version_used(policy, stage, step, P, T, **kw) -> int:
    return sched(policy, P, T, **kw).version(stage, step)


def max_staleness(policy, P) -> list[int]:
    return list(DelaySchedule.build(policy, P).max_tau)


def versions_needed_after(policy, stages, step, P, T, sync_start=0, sync_cooldown=0.0):
    return sched(policy, P, T, sync_start, sync_cooldown).versions_needed_after(stages, step)


def taus(policy: str, P: int, step: int = 5, T: int = 100, **kw) -> list[int]:
    return [staleness(policy, s, step, P, T, **kw) for s in range(P)]


def test_policy_values_by_hand():
    assert taus("sync", 4) == [0, 0, 0, 0]
    assert taus("2bw", 4) == [1, 1, 1, 1]
    assert taus("pipedream", 4) == [3, 2, 1, 0]  # first stage stalest
    assert taus("fixed:3", 4) == [3, 3, 3, 3]
    assert taus("fixed:0", 2) == [0, 0]
    # WPipe: G0 = first half of the partitions, stale by one; G1 = second half, fresh.
    assert taus("wpipe", 4) == [1, 1, 0, 0]
    assert taus("wpipe", 2) == [1, 0]
    assert taus("wpipe", 6) == [1, 1, 1, 0, 0, 0]
    assert [wpipe_group(s, 4) for s in range(4)] == [0, 0, 1, 1]


@pytest.mark.parametrize("policy", [*DELAY_POLICIES, "fixed:2"])
def test_every_policy_is_a_pure_bounded_function(policy):
    P = 4
    top = max_staleness(policy, P)
    for step in range(12):
        for s in range(P):
            tau = staleness(policy, s, step, P, 12)
            assert tau == staleness(policy, s, step, P, 12)  # pure
            assert 0 <= tau <= top[s]
            assert version_used(policy, s, step, P, 12) == max(step - tau, 0)


def test_versions_clamp_at_zero():
    # steps 0 and 1 of 2BW both read W_0, as in the PipeDream-2BW code
    assert [version_used("2bw", 0, k, 1, 10) for k in range(4)] == [0, 0, 1, 2]
    assert [version_used("pipedream", 0, k, 3, 10) for k in range(4)] == [0, 0, 0, 1]


def test_sync_windows_switch_at_the_right_steps():
    T = 10
    got = [staleness("2bw", 0, k, 1, T, sync_start=3, sync_cooldown=2) for k in range(T)]
    assert got == [0, 0, 0, 1, 1, 1, 1, 1, 0, 0]
    got = [staleness("2bw", 0, k, 1, T, sync_cooldown=0.3) for k in range(T)]
    assert got == [1] * 7 + [0] * 3
    # no gradient skipped or reused: step 3 reads W_2, step 8 reads W_8
    assert version_used("2bw", 0, 3, 1, T, sync_start=3) == 2
    assert version_used("2bw", 0, 8, 1, T, sync_cooldown=2) == 8
    assert cooldown_steps(0.25, 40) == 10 and cooldown_steps(7, 40) == 7
    assert sched("2bw", 1, 10, sync_start=1).in_sync_window(0)
    assert not sched("2bw", 1, 10, sync_start=1).in_sync_window(1)


def test_versions_needed_never_exceed_max_tau():
    for policy in ["2bw", "pipedream", "fixed:3", "wpipe"]:
        P, T = 4, 20
        for k in range(T):
            for s in range(P):
                need = versions_needed_after(policy, [s], k, P, T, 2, 3)
                assert len(need) <= max_staleness(policy, P)[s]
                assert all(v <= k for v in need)
    # nothing kept inside a start window no delayed step follows soon
    assert versions_needed_after("2bw", [0], 0, 1, 20, sync_start=5) == set()
    assert versions_needed_after("2bw", [0], 4, 1, 20, sync_start=5) == {4}
    assert versions_needed_after("2bw", [0], 17, 1, 20, sync_cooldown=2) == set()


def test_weight_prediction_keeps_the_version_before_each_read():
    # hand-computed: a predicted read of W_v (tau >= 1, v >= 1) also needs W_{v-1}
    def need(policy, stage, step, P=3, **windows):
        return sched(policy, P, 20, **windows).versions_needed_after([stage], step, predict=True)

    assert need("2bw", 0, 4) == {3, 4}  # step 5 reads W_4 (and W_3), step 6 W_5 (and W_4)
    assert need("pipedream", 0, 5) == {3, 4, 5}  # tau 2: steps 6, 7, 8 read W_4, W_5, W_6
    assert need("pipedream", 2, 5) == set()  # the last stage is fresh
    assert need("2bw", 0, 0) == {0}  # step 1 reads W_0 (W_{-1} = W_0: nothing more)
    # the sync start's end: step 5 reads W_4 again, predicted from W_3
    assert need("2bw", 0, 3, sync_start=5) == {3}
    assert need("2bw", 0, 4, sync_start=5) == {3, 4}


def test_bad_policies_get_clear_messages():
    with pytest.raises(ConfigError, match="unknown delay policy 'async'"):
        staleness("async", 0, 0, 2, 10)
    with pytest.raises(ConfigError, match="fixed:N needs an integer N >= 0"):
        staleness("fixed:-1", 0, 0, 2, 10)
    with pytest.raises(ConfigError, match="wpipe needs an even pipeline.num_stages"):
        staleness("wpipe", 0, 0, 3, 10)
    with pytest.raises(ConfigError, match="sync_start must be >= 0"):
        staleness("2bw", 0, 0, 2, 10, sync_start=-1)


@pytest.mark.parametrize(
    ("kw", "msg"),
    [
        ({"policy": "bogus"}, "delay.policy must be"),
        ({"policy": "fixed:-2"}, "fixed:N needs an integer"),
        ({"sync_start": -1}, "delay.sync_start must be >= 0"),
        ({"sync_cooldown": -0.1}, "delay.sync_cooldown must be >= 0"),
        ({"sync_cooldown": 2.5}, "whole number"),
        ({"taylor": -1.0}, "delay.taylor must be >= 0"),
        ({"mode": "slow"}, "delay.mode"),
    ],
)
def test_delay_config_validation(kw, msg):
    with pytest.raises(ConfigError, match=msg):
        DelayConfig(**kw)


def test_cooldown_aligned_with_wsd_decay():
    train = TrainConfig(num_steps=100, lr_schedule="wsd", decay_frac=0.2)
    cfg = resolve_delay_config(DelayConfig(policy="2bw", sync_cooldown_wsd=True), train)
    assert cfg.sync_cooldown == 20 and not cfg.sync_cooldown_wsd
    got = [staleness("2bw", 0, k, 1, 100, sync_cooldown=cfg.sync_cooldown) for k in (79, 80)]
    assert got == [1, 0]
    with pytest.raises(ConfigError, match="lr_schedule wsd"):
        resolve_delay_config(DelayConfig(sync_cooldown_wsd=True), TrainConfig(num_steps=10))


def test_a_policy_answers_whether_it_delays_and_whether_p_matters():
    """Code outside delay/ asks these instead of comparing names (issue 43): a registered
    policy answers for itself, with no list to update."""
    from stalepipe.config.registry import DELAY_POLICIES
    from stalepipe.training.delay.policies import Policy, never_delays, same_delay_at_any_depth

    assert [never_delays(p) for p in ("sync", "fixed:0", "2bw", "pipedream")] == [1, 1, 0, 0]
    assert [same_delay_at_any_depth(p) for p in ("2bw", "fixed:3", "pipedream", "wpipe")] == [
        1, 1, 0, 0,
    ]  # fmt: skip
    DELAY_POLICIES.register(Policy("lagged-2", lambda s, k, P: 2, lambda s, P: 2))
    try:
        assert not never_delays("lagged-2") and same_delay_at_any_depth("lagged-2")
    finally:
        DELAY_POLICIES.unregister("lagged-2")
