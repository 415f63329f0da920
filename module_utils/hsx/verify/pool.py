"""Forked workers for verification: fork_map runs parts of the work in children, reap collects them.

Children inherit everything (nothing is pickled on the way in) and send back one pickled result
through a pipe; a child that dies without a whole result is an error, never a pass.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any


def fork_map(
    fn: Callable[..., Any], parts: list[tuple[Any, ...]], reap: list[int] | None = None
) -> list[Any]:
    """[fn(*p) for p in parts]: parts[1:] each in a forked child, parts[0] in this process.

    Children inherit everything (no pickling of the work) and send back one pickled result
    through a pipe; no pool is started, which for `quick` can cost more than the whole run.
    A child that dies without a result is an error (raised here), not a pass; so is a result
    that is an exception. With `reap` (a list), a child whose whole result arrived is not
    waited for here: its pid goes into `reap` for the caller to collect later (reap()), so
    that its exit (unmapping its copy of a large parent) overlaps the caller's work.
    """
    import pickle

    children = []
    for part in parts[1:]:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # child: never return into the caller's code
            code = 0
            try:
                os.close(r)
                payload = pickle.dumps(fn(*part), protocol=pickle.HIGHEST_PROTOCOL)
            except BaseException as e:  # report it; the parent raises
                payload, code = pickle.dumps(RuntimeError(f"verify worker failed: {e!r}")), 1
            try:
                view = memoryview(payload)
                while view:
                    view = view[os.write(w, view) :]
                os.close(w)  # the result is complete before this process starts to exit
            finally:
                os._exit(code)
        os.close(w)
        children.append((pid, r))
    try:
        results = [fn(*parts[0])]
    except BaseException:  # this process failed: wait for every child, then raise
        for pid, r in children:
            with os.fdopen(r, "rb") as f:
                f.read()
            os.waitpid(pid, 0)
        raise
    pending = []
    for pid, r in children:
        with os.fdopen(r, "rb") as f:
            pending.append((pid, f.read()))
    error: BaseException | None = None
    for pid, data in pending:
        try:
            result = pickle.loads(data) if data else None
        except Exception:  # cut short: the child died while writing it
            result = None
        if reap is not None and result is not None and not isinstance(result, BaseException):
            reap.append(pid)
        else:
            status = os.waitpid(pid, 0)[1]
            if error is None and (status != 0 or result is None or isinstance(result, BaseException)):
                error = (
                    result
                    if isinstance(result, BaseException)
                    else RuntimeError(f"verify worker died (wait status {status})")
                )
        results.append(result)
    if error is not None:
        raise error
    return results


_EXITING: list[int] = []  # forked workers that sent their result and may still be exiting


def reap(pids: list[int]) -> None:
    """Collect the children fork_map left to the caller, without waiting for any still exiting.

    A worker that has sent its whole result only has its exit left (unmapping its copy of the
    parent): it runs while the caller goes on, and the child is collected here on a later call
    (as subprocess does), or by init.
    """
    _EXITING.extend(pids)
    pids.clear()
    for pid in list(_EXITING):
        try:
            done = os.waitpid(pid, os.WNOHANG)[0]
        except ChildProcessError:  # collected by someone else's wait()
            done = pid
        if done:
            _EXITING.remove(pid)
