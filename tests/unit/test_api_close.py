"""The HTTP handler's cleanup aborts every choice's request even when it is cancelled itself
(the client went away while the first abort was on its way)."""

from __future__ import annotations

import asyncio

from tetri_server.api.handlers import GenerateHandlers


class Choice:
    def __init__(self, closed: list[int], index: int) -> None:
        self.closed, self.index = closed, index

    async def close(self, *, client_gone: bool = False) -> None:
        await asyncio.sleep(0.05)  # the abort travels to the control process
        self.closed.append(self.index)


def test_a_cancel_during_the_first_abort_leaves_no_choice_running() -> None:
    """Regression (review of session 62): the choices were aborted one at a time, each under
    its own shield; a cancel of the handler during the first left the others generating to
    max_tokens (n > 1, batched prompts)."""

    async def main() -> list[int]:
        closed: list[int] = []
        gens = [Choice(closed, i) for i in range(4)]
        task = asyncio.ensure_future(GenerateHandlers._close(gens, True))  # type: ignore[arg-type]
        await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0.2)
        return closed

    assert sorted(asyncio.run(main())) == [0, 1, 2, 3]


def test_a_choice_whose_abort_fails_leaves_the_others_aborted_and_is_logged(caplog) -> None:
    """One failing abort neither stops the others nor turns the finished reply into a 500."""

    class Failing(Choice):
        async def close(self, *, client_gone: bool = False) -> None:
            raise RuntimeError("channel gone")

    async def main() -> list[int]:
        closed: list[int] = []
        gens = [Failing(closed, 0), Choice(closed, 1), Choice(closed, 2)]
        await GenerateHandlers._close(gens, False)  # type: ignore[arg-type]
        return closed

    assert sorted(asyncio.run(main())) == [1, 2]
    assert "channel gone" in caplog.text
