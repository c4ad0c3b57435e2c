"""The Ray runtime: placement, trainer groups and the driver of each job.

`dispatch` is the only entry the CLI calls; it imports the job's driver (`JobSpec.driver` in the job table,
`miles.config.jobs`) lazily, so resolving and printing args never imports torch or Ray.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from miles.core.errors import ConfigError, RuntimeUnavailable
from miles.utils.dotted import import_dotted

if TYPE_CHECKING:
    from miles.config.resolve import ResolvedJob


def dispatch(resolved: ResolvedJob) -> int | None:
    """Run the job's driver: what fails inside an actor becomes one line (`miles.runtime.failures`; a user's
    mistake found there is re-raised as the same ConfigError, exit 2), Ctrl-C/SIGTERM exit 130/143."""
    run = _driver(resolved)
    from miles.runtime.failures import report_failure
    from miles.runtime.signals import as_interrupt, interrupts, last_checkpoint_line

    args = resolved.args
    from miles.utils.deadline import set_hook_timeout

    set_hook_timeout(args.hook_timeout)  # the hooks the driver runs (log functions)
    import miles.runtime.host_watch as host_watch

    host_watch.reset()  # no lost host of an earlier job in this process
    with interrupts():
        try:
            code = run(resolved)
            if not code and args.output_dir:  # done: its folders are not written over (`finished`)
                from miles.io.finished import mark_finished

                mark_finished(args, resolved.spec.command)
            return code
        except KeyboardInterrupt as exc:
            import miles.runtime.host_watch as host_watch

            if host_watch.lost() is not None:  # a lost host (`host_watch.HostLost`), however Ray passed it on
                return report_failure(exc, args)
            # Ctrl-C or SIGTERM, raised by our handler or, inside a wait on Ray, as Ray's own KeyboardInterrupt
            interrupt = as_interrupt(exc)
            print(f"miles: interrupted ({interrupt}); {last_checkpoint_line(args)}", file=sys.stderr, flush=True)
            return interrupt.exit_code
        except ConfigError:
            raise
        except Exception as exc:
            return report_failure(exc, args)
        finally:
            set_hook_timeout(None)
            import miles.runtime.host_watch as host_watch

            host_watch.settle()  # the job ended its own way: no forced exit after a lost host


def _driver(resolved: ResolvedJob) -> Callable[[ResolvedJob], int | None]:
    """The job's `run` function, named by its row of the job table as `module:function`."""
    module_name = resolved.spec.driver.partition(":")[0]
    try:
        return import_dotted(resolved.spec.driver)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        raise RuntimeUnavailable(
            f"the `miles {resolved.spec.command}` runtime is not available yet; the args above resolved cleanly"
        ) from None
