"""A multi-turn workflow: the model answers; when the answer is wrong, a checker says so (a tool
message) and the model tries again, up to ``max_turns`` answers.

stalebound constructs ``SecondChance(**rollout.workflow_args)`` once and calls
``await workflow.arun_episode(engine, row)`` for every episode. ``engine.agenerate`` runs one
model turn, ``engine.score`` is the run's reward of an answer, and ``encode_tool_reply`` puts the
checker's reply in as a ``tool`` message through the tokenizer's chat template (as plain text
with the built-in character tokenizer).
"""

from stalebound import Trajectory
from stalebound.tasks import decode_text, encode_tool_reply


class SecondChance:
    def __init__(self, max_turns=2, reply="no;", discount=0.5):
        self.max_turns = max_turns
        self.reply = reply  # what the checker says to a wrong answer
        self.discount = discount  # a right answer after n wrong ones earns discount ** n

    async def arun_episode(self, engine, row):
        tokenizer = engine.tokenizer
        prompt_ids = engine.encode_row(row)
        messages = [{"role": "user", "content": engine.task.prompt(row)}]
        out, logprobs, versions, mask = [], [], [], []
        for turn in range(self.max_turns):
            gen = await engine.agenerate(prompt_ids + out)
            out += gen.output_ids
            logprobs += gen.output_logprobs
            versions += gen.output_versions
            mask += [1] * len(gen.output_ids)  # the model's tokens are trained on
            answer = decode_text(tokenizer, gen.output_ids)
            truncated = gen.finish_reason != "stop"
            metrics = await engine.score(row, answer, truncated=truncated)
            if truncated or metrics["score"] >= 1.0 or turn + 1 == self.max_turns:
                break
            messages.append({"role": "assistant", "content": answer})
            reply = encode_tool_reply(tokenizer, messages, self.reply)
            messages.append({"role": "tool", "content": self.reply})
            out += reply
            logprobs += [0.0] * len(reply)
            versions += [versions[-1]] * len(reply)
            mask += [0] * len(reply)  # the checker's tokens are not
        reward = metrics["score"] * self.discount**turn
        return Trajectory(
            prompt_ids=prompt_ids,
            output_ids=out,
            behaviour_logprobs=logprobs,
            versions=versions,
            reward=reward,
            truncated=truncated,
            loss_mask=mask,
            sample_id=row.id,
            response=answer,
            metrics={**metrics, "score": reward, "turns": float(turn + 1)},
        )
