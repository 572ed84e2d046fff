"""Reward functions for the end-to-end tests (module-level, so worker processes can import them)."""


def fraction_of_a(prompts, completions, **columns):
    """A trivially learnable reward: the share of 'a' characters in the completion."""
    return [c.count("a") / max(len(c), 1) for c in completions]


def contains_a(prompts, completions, **columns):
    """A 0/1 reward a random tiny model earns now and then: the completion contains an 'a'."""
    return [float("a" in c) for c in completions]


def slow_contains_a(prompts, completions, **columns):
    """`contains_a`, taking 20 ms per completion: verification time dominates a tiny model's step."""
    import time

    time.sleep(0.02 * len(completions))
    return contains_a(prompts, completions)


def length_score(prompts, completions, **columns):
    """A dense reward that differs between almost any two completions: the completion's length."""
    return [len(c) / 10.0 for c in completions]
