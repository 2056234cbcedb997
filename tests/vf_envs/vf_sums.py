"""A verifiers 0.4 taskset (its `verifiers.v1` API) with its own harness: the embedded task's sums.

    task    = SumsData(prompt="12+34=", answer="46")            the taskset's config: num_train, seed,
    harness = ChatHarness: one chat call through the endpoint     constant_reward
              verifiers hands it (its interception server, which records the call on the trace)
    reward  = exact_answer: 1.0 when the last reply, stripped, is the answer, else 0.0; or
              `constant_reward` for every reply (a score that shows where a logged reward comes from)

A harness is verifiers' program that plays the task. Its built-in ones (`null`, `bash`, ...) run a
program that `uv` installs in the runtime; this one asks the model in-process, as verifiers allows
("a harness may run its loop in-process ... as long as every model call goes through endpoint +
secret"), so the tests run offline. The module exports both through `__all__`, so the taskset's
default harness is its own.
"""

import verifiers.v1 as vf
from openai import AsyncOpenAI
from vf_addition import sums

__all__ = ["SumsTaskset", "ChatHarness"]


class SumsData(vf.TaskData):
    answer: str
    constant_reward: float | None = None


class SumsTask(vf.Task[SumsData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def exact_answer(self, trace) -> float:
        if self.data.constant_reward is not None:
            return self.data.constant_reward
        return 1.0 if trace.last_reply == self.data.answer else 0.0


class SumsConfig(vf.TasksetConfig):
    num_train: int = 200
    seed: int = 0
    constant_reward: float | None = None


class SumsTaskset(vf.Taskset[SumsTask, SumsConfig]):
    def load(self):
        for row in sums(self.config.num_train, self.config.seed):
            data = SumsData(
                prompt=row["prompt"][0]["content"], answer=row["answer"], constant_reward=self.config.constant_reward
            )
            yield SumsTask(data, self.config.task)


class ChatHarnessConfig(vf.HarnessConfig):
    pass


class ChatHarness(vf.Harness[ChatHarnessConfig]):
    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **kwargs) -> vf.ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": prompt})
        async with AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as client:
            await client.chat.completions.create(model=ctx.model, messages=messages)
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")
