"""User reward functions for tests/test_grpo.py, named as `grpo_rewards:<function>`."""


def starts_with_a_digit(prompts, completions, **fields):
    return [float(c[:1].isdigit()) for c in completions]


def raises(prompts, completions, **fields):
    raise KeyError("no such judge")


def one_value_too_few(prompts, completions, **fields):
    return [0.0] * (len(completions) - 1)
