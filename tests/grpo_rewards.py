"""User reward functions for tests/test_grpo.py, named as `grpo_rewards:<function>`."""


def starts_with_a_digit(prompts, completions, **fields):
    return [float(c[:1].isdigit()) for c in completions]


def raises(prompts, completions, **fields):
    raise KeyError("no such judge")


def one_value_too_few(prompts, completions, **fields):
    return [0.0] * (len(completions) - 1)


def odd_first_byte(prompts, completions, **fields):
    """About half of an untrained model's completions: advantages of both signs."""
    return [float(bool(c) and ord(c[0]) % 2 == 1) for c in completions]
