"""One torch thread for these tiny problems: on 2 shared cores, thread hand-offs cost more than the math."""

from tests.support.threads import one_thread  # noqa: F401  # an autouse fixture: importing it applies it here
