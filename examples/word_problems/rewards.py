"""A reward for the word problems: the last number in the answer, compared with the reference.

stalebound calls ``score(prompt, completion, **columns)``: ``answer`` and ``topic`` are columns of
problems.jsonl. The extra key ``stated_number`` is logged next to the reward.
"""

from stalebound.rewards import extract_answer, parse_number


def score(prompt, completion, answer, topic="", **columns):
    got = parse_number(extract_answer(completion))
    if got is None:
        return {"reward": 0.0, "stated_number": 0.0}
    return {"reward": float(got == float(answer)), "stated_number": 1.0}
