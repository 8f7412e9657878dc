"""How a training run stops: the first Ctrl-C, SIGTERM or SIGHUP asks the loop to checkpoint and
stop after its step (``StopFlag``); a hung-up terminal is detached so the lines printed after it
cannot break the save (``detach_terminal``)."""

from __future__ import annotations

import os


class StopFlag:
    """First Ctrl-C (or SIGTERM, which torchrun sends its workers on Ctrl-C, or SIGHUP, which
    the terminal or ssh session sends when it closes): finish and checkpoint the current step,
    then stop. A second one: stop now."""

    def __init__(self):
        self.requested = False

    def installed(self):
        import contextlib
        import signal
        import threading

        if threading.current_thread() is not threading.main_thread():
            return contextlib.nullcontext()

        @contextlib.contextmanager
        def scope():
            def handler(signum, frame):
                if self.requested:
                    raise KeyboardInterrupt
                self.requested = True
                if signum == signal.SIGHUP:  # the terminal is gone: its writes would fail (EIO)
                    detach_terminal()

            previous = {
                sig: signal.signal(sig, handler)
                for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
            }
            try:
                yield
            finally:
                for sig, old in previous.items():
                    signal.signal(sig, old)

        return scope()


def detach_terminal() -> None:
    """After SIGHUP: point stdout and stderr at /dev/null where they were the closed terminal,
    so the lines after it (``saved …``) cannot fail the checkpoint that follows."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        for fd in (1, 2):
            if os.isatty(fd):
                os.dup2(devnull, fd)
    finally:
        os.close(devnull)
