"""`StepPlan`: a run's cadence and what its processes agreed on, as values; the request bits
are the peers' (`peers.interrupts`), turned into an `Agreed` by `agreement`."""

from stalepipe.config import TrainConfig
from stalepipe.training.peers.interrupts import CHECKPOINT, STOP, agreement, no_requests
from stalepipe.training.schedules.plan import Agreed, StepPlan


def _plan(**kw) -> StepPlan:
    return StepPlan(TrainConfig(num_steps=10, ckpt_every=0, eval_every=5, log_every=2, **kw))


def test_a_vote_becomes_an_agreement_only_when_someone_asked():
    assert agreement(3, no_requests()) is None
    assert agreement(3, CHECKPOINT) == Agreed(3, stop=False)
    assert agreement(3, STOP) == Agreed(3, stop=True)
    assert agreement(3, STOP | CHECKPOINT) == Agreed(3, stop=True)


def test_the_cadence_is_the_configs_and_the_last_step_does_everything():
    plan = _plan()
    assert [k for k in range(10) if plan.logs(k)] == [1, 3, 5, 7, 9]
    assert [k for k in range(10) if plan.evaluates(k)] == [4, 9]
    assert [k for k in range(10) if plan.checkpoints(k)] == [9]
    assert plan.stop_step is None and not any(plan.stops(k) for k in range(10))


def test_an_agreed_checkpoint_is_a_new_plan_that_checkpoints_there():
    plan = _plan()
    later = plan.with_agreed(agreement(3, CHECKPOINT))
    assert later is not plan and plan.agreed == ()  # the old plan never changes
    assert later.checkpoints(3) and later.is_sync_point(3) and not later.stops(3)
    assert later.stop_step is None and later.agreed_at(3) == Agreed(3)
    assert later.agreed_at(4) is None and not later.checkpoints(4)


def test_a_stop_ends_the_run_at_the_first_step_agreed():
    plan = _plan().with_agreed(Agreed(6, stop=True)).with_agreed(Agreed(2, stop=True))
    assert plan.stop_step == 2 and plan.stops(2) and plan.stops(6) and not plan.stops(3)
    assert plan.checkpoints(2) and plan.checkpoints(6)


def test_two_agreements_on_one_step_read_as_one_that_stops_if_either_does():
    plan = _plan().with_agreed(Agreed(4)).with_agreed(Agreed(4, stop=True))
    assert plan.agreed_at(4) == Agreed(4, stop=True) and plan.stops(4)


def test_nothing_or_the_last_step_changes_nothing():
    plan = _plan()
    assert plan.with_agreed(None) is plan
    assert plan.with_agreed(Agreed(9, stop=True)) is plan  # the last step ends anyway
    assert plan.with_agreed(Agreed(12)) is plan
