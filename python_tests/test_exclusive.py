"""ExclusiveUse, the claim attach() and FastSpeculativeDecoder.generate take on their models: what
it holds, what it releases, and that its check runs under the claims' lock."""
import threading

import pytest

from flashhead_ext._exclusive import ExclusiveUse


class Busy(RuntimeError):
    pass


def _claims():
    return ExclusiveUse(lambda: Busy("claimed in another call"))


def test_none_is_skipped_and_objects_are_claimed_by_identity():
    claim = _claims()
    first, second = [1], [1]  # equal, not the same object
    with claim(first, None):
        with claim(second, None):  # a driver without a draft passes None: that claims nothing
            pass
        with pytest.raises(Busy, match="claimed in another call"):
            with claim(None, first):
                pass


def test_leaving_a_block_releases_its_own_claims_only():
    claim = _claims()
    outer, inner = object(), object()
    with claim(outer):
        with claim(inner):
            pass
        with pytest.raises(Busy):  # the inner block's release left the outer claim in place
            with claim(outer):
                pass
        with claim(inner):  # released
            pass
    with pytest.raises(ValueError, match="inside"):
        with claim(outer, inner):
            raise ValueError("inside")
    with claim(outer, inner):  # released by an exception too
        pass


def test_the_check_runs_before_the_busy_test_and_a_failed_check_claims_nothing():
    claim = _claims()
    held, free = object(), object()

    def refuse():
        raise ValueError("check failed")

    with claim(held):
        with pytest.raises(ValueError, match="check failed"):  # the check's own error, not busy
            with claim(held, check=refuse):
                pass
        with pytest.raises(ValueError, match="check failed"):
            with claim(free, check=refuse):
                pass
        with claim(free):  # the failed check took no claim
            pass


def test_the_check_runs_under_the_claims_lock():
    # What the check tests (e.g. attach's "no FlashHead attached yet") must still hold when the claim
    # is taken: another thread's claim of the same object waits for it, then finds the object busy.
    claim = _claims()
    model = object()
    outcome = []

    def other_thread():
        try:
            with claim(model):
                outcome.append("claimed")
        except Busy:
            outcome.append("busy")

    def check():
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join(1.0)
        outcome.append("waiting" if thread.is_alive() else "done")
        check.thread = thread

    with claim(model, check=check):
        check.thread.join(60)  # the other thread ran on once the claim was taken
    assert outcome == ["waiting", "busy"]
