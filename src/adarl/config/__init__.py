"""The recipe schema: one YAML file describes a whole run.

Every section is a strict pydantic model: an unknown key, a wrong type or a missing file is
an error that names the key, what was expected and the closest valid key, raised before any
model is loaded. Stages chosen by name (select, allocate, advantage, loss) take
``{name: ..., <that component's parameters>}`` and are checked against the registry.

One module per section (base, model, task, reward, rollout, cluster, train), the whole recipe in
recipe.py, and the loader with its errors in loader.py; every name is importable from `adarl.config`.
"""

from adarl.config.base import (  # noqa: F401
    MAX_COUNT,
    MAX_RECIPE_DEPTH,
    MAX_RECIPE_VALUES,
    MAX_SECONDS,
    Section,
    TokenCount,
    bool_counts,
)
from adarl.config.cluster import (  # noqa: F401
    ClusterConfig,
    SapoConfig,
    WorkerResources,
)
from adarl.config.loader import (  # noqa: F401
    AUTO_BACKEND_ENV,
    RecipeError,
    _check_size,
    builtin_recipe,
    builtin_recipes,
    dump_recipe,
    load_recipe,
    parse_overrides,
    pick_backend,
    recipe_schema,
    resolve_backend,
)
from adarl.config.model import (  # noqa: F401
    LoraConfig,
    ModelConfig,
)
from adarl.config.recipe import (  # noqa: F401
    RUN_NAME,
    Recipe,
)
from adarl.config.reward import (  # noqa: F401
    RewardConfig,
)
from adarl.config.rollout import (  # noqa: F401
    AdaptiveTemperature,
    AgentConfig,
    ArpoConfig,
    BranchingConfig,
    BudgetSentencesConfig,
    EptreeBranching,
    LatrBranching,
    OpenEnvConfig,
    RolloutConfig,
    SchedulerConfig,
    TreepoBranching,
    VllmConfig,
)
from adarl.config.task import (  # noqa: F401
    TASK_SOURCES,
    MixtureShare,
    TaskConfig,
)
from adarl.config.train import (  # noqa: F401
    MISMATCH_BANDS,
    TRACKERS,
    BudgetConfig,
    CheckpointConfig,
    DistillConfig,
    EvalConfig,
    LogConfig,
    MismatchConfig,
    TrainConfig,
)
