"""Exceptions that stand for expected failures, shown to people without a traceback."""


class UserError(Exception):
    """An expected failure: bad input, a missing service, a refused request.

    The message is one or more sentences that say what is wrong and how to fix
    it; the CLI prints it without a traceback and exits with `exit_code`.
    """

    exit_code = 1


class ConfigError(UserError):
    """The configuration file has one or more problems, each with its key path."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = problems
        listing = "\n".join(f"  - {problem}" for problem in problems)
        count = len(problems)
        noun = "problem" if count == 1 else "problems"
        super().__init__(f"{source}: {count} {noun} in the configuration:\n{listing}")


class EventError(Exception):
    """A calendar event (or one of its values) that cannot be read; the message says why.

    Not a `UserError`: it never stops a command, it becomes the reason a
    booking is refused, told to whoever booked it.
    """
