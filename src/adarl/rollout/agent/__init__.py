"""Multi-turn tool use: a generator that runs each rollout as an agent trajectory.

    AgentGenerator(generator, env_factory, problems, ...).generate(requests) -> rollouts

wraps any generator (hf, vllm) and keeps its `generate` signature, so the scheduler, the budget
and the learner see ordinary rollouts. Each row is one trajectory:

    generate until the end of the turn or a tool call  →  parse  →  run the tools  →
    append the tool turn  →  continue                  (until no call, a limit, or the budget)

Token in, token out: the ids the policy sampled are kept as `model` spans and never
re-tokenised; the tool turn is rendered by the chat template and appended as `template` and
`tool` spans (not sampled: never trained, never counted as generated). `AgentGenerator.check`
verifies at start-up that the template extends earlier turns verbatim, else it says so.

Environments come in three styles (`rollout.agent.style`, `environment_style`). "tools" (TRL's
environment_factory duck type, no TRL import): a class with `reset(**row)`, and every other public
method a tool, described to the model by its type hints and docstring (`tool_schemas`); an optional
`get_reward()` becomes the rollout's `env_reward`. "gym": `step(text) -> (observation, reward, done,
info)` answers every model turn (rendered as a user turn), its rewards add up in `env_reward`, and
`done` ends the trajectory ("env_done"). "openenv": an OpenEnv server (rollout/openenv.py), gym-like.
"auto" never guesses: a `step` is gym's only when annotated to return a tuple, a tool when annotated to
return anything else (TRL's echo example: `def step(self, message: str) -> str`), and an unannotated
one is an error asking for `style`. One instance per rollout, reset with the problem's row (prompt,
answer and its columns); what `reset` returns is shown to the model in every style, appended to the
first user message (`messages`, as TRL does): the prompt is built once per problem from a probe
environment, and a trajectory whose own reset shows something else is censored ("reset_mismatch").
Built-in environments are in tools.py (`calculator`).

Failures are of two kinds. The model's own mistakes (a malformed call, an unknown tool, bad
arguments, a tool raising an error) become a tool message the model reads, and are counted
(`agent/errors/<kind>`). A call is malformed too when it nests deeper than MAX_ARGUMENT_DEPTH or
escapes half a surrogate pair; the parsers scan the text once. The environment's failures censor the
rollout: finish reason "censored", never scored (the trainer drops it from its group and counts it),
counted by cause in `agent/censored/<why>`: "error" (construction, `reset`, `step` or `get_reward`
raising anything, a tool raising `EnvironmentFailure` or an error that cannot be shown), "timeout"
(construction and `reset` past `reset_timeout_s`, a tool call, `step` or `get_reward` past
`tool_timeout_s`) and "non_finite_reward" (a NaN or infinite reward). Every call into the environment
runs in a pool of daemon threads (rollout/daemon_pool.py) that fails it at its deadline (counted from
when the call starts running, not from when it was queued), so a hang neither blocks `generate` nor
keeps the process from exiting. Limits: `max_turns` model turns,
`max_tool_calls`, tool output truncated to `max_tool_output_tokens` with a visible marker (cut to
CHARS_PER_TOKEN characters a token before it is tokenised), and `max_context_tokens` tokens after
the prompt (sampled and inserted).

Rows run in waves. A row whose turn ended with tool calls leaves the decoding batch while its
calls run in the pool (all calls of a turn at once, each bounded by `tool_timeout_s`), and
rejoins at the next wave after its results are back; the other rows go on decoding meanwhile, so
one slow tool stalls only its own row. The generator waits for tools only when no row can decode.
Sampling is keyed per row and position (rollout/hf.py), so a trajectory's tokens do not depend on
which wave it decoded in.

Partial and async generation (rollout/scheduler.py) work across turns. `stop_when` sees one row per
trajectory (finished when the trajectory is) and is checked during every decoding step and between
waves; a stopped row comes back "partial" with its turns so far, tool turns included. A request
whose `prefix_spans` hold such a partial trajectory continues it: with the environment this
generator still holds for it, or, after a resume from a checkpoint (or in another process), with a
fresh environment into which the recorded tool calls are replayed in order. Replay assumes
deterministic tools: a replayed result that differs from the recorded one censors the rollout
(`agent/replay_mismatches`). Branching (ARPO/AEPO) and CLEANER's purification need sync mode.

With `purify` (CLEANER's Similarity-Aware Adaptive Rollback, `saar`), a failed tool step is replaced
by the turn that corrects it, its call or the whole turn by the two calls' similarity, while sampling
(`_roll_back`, the released code's way) or once the trajectory ends (`purify`); spliced model spans are
flagged (`Span.rollback`). With `branching` (rollout/arpo.py: ARPO, AEPO) a request's n
trajectories are grown as a tree: a few chains start from the prompt, a chain may branch after a
tool turn (the branch shares its spans and gets a copy of its environment), and fresh chains fill
the slots left.

The package, by concern: `loop` (AgentGenerator, the trajectories), `environments` (styles, tools,
observations, `EnvironmentFailure`), `parsers` (tool calls), `cleaner` (CLEANER's rollback). Neither
the parsers nor the environments import the loop; rollout/tools.py and rollout/openenv.py import
only them.
"""

from adarl.rollout.agent.cleaner import ROLLBACK_RETRIES, ROLLBACK_SIMILARITY, call_start, purify, saar
from adarl.rollout.agent.environments import (
    STYLES,
    EnvironmentFailure,
    close_env,
    environment_style,
    observation_text,
    tool_schemas,
    tools_of,
    tools_prompt,
    with_observation,
    with_tools,
)
from adarl.rollout.agent.loop import CENSORED_BY, CHARS_PER_TOKEN, TRUNCATED, AgentGenerator, turns_of
from adarl.rollout.agent.parsers import (
    MAX_ARGUMENT_DEPTH,
    PARSERS,
    MalformedCall,
    Parser,
    ToolCall,
    parse_python_block,
    parse_tool_call,
)

__all__ = ["CENSORED_BY", "CHARS_PER_TOKEN", "MAX_ARGUMENT_DEPTH", "PARSERS", "Parser", "ROLLBACK_RETRIES",
           "ROLLBACK_SIMILARITY", "STYLES", "TRUNCATED", "AgentGenerator", "EnvironmentFailure", "MalformedCall",
           "ToolCall", "call_start", "close_env", "environment_style", "observation_text", "parse_python_block",
           "parse_tool_call", "purify", "saar", "tool_schemas", "tools_of", "tools_prompt", "turns_of",
           "with_observation", "with_tools"]
