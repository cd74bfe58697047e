"""llama-server's command line for ``pyspec serve``: one table from llama.cpp's common/arg.cpp, one mapping.

A deployment script written for llama-server (``llama-server -m X -c 8192 -np 4 -fa off -md D
--spec-draft-n-max 8 --chat-template chatml --jinja --metrics ...``) starts ``pyspec serve``
unchanged:

- :data:`LLAMA_SERVER_OPTIONS` lists every option llama-server accepts at the pinned revision
  (names, negations, how many values), read from ``vendor/llama.cpp/common/arg.cpp`` by
  :func:`parse_arg_cpp` (tests/test_serve_args.py checks the table against the vendored file);
- :data:`MAPPED` gives the ones that mean something for pyspec their argparse form (same long and
  short names as llama-server; pyspec's own names keep working beside them);
- :func:`env_argv` reads llama-server's ``LLAMA_ARG_*`` environment variables (docker images set them);
- :func:`filter_argv` drops every other llama-server option with its value before argparse sees it,
  so a start-up never fails on a llama-server option; :func:`resolve` turns the parsed options into
  what ``cmd_serve`` passes on (llama-server's meaning: ``--ctx-size`` is the total over the slots)
  and names, in one warning, what pyspec does not apply.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pyspec.errors import CliError

__all__ = ["LLAMA_SERVER_ENV", "LLAMA_SERVER_OPTIONS", "MAPPED", "ArgCppOption", "Mapped", "ServeOptions",
           "add_llama_server_args", "env_argv", "filter_argv", "parse_arg_cpp", "resolve", "server_options",
           "table_lines"]


# --------------------------------------------------------------------------- arg.cpp


@dataclasses.dataclass(frozen=True)
class ArgCppOption:
    """One ``add_opt(common_arg(...))`` of arg.cpp: its names (negations too), values, examples."""

    names: tuple[str, ...]
    n_values: int  # 0: a flag (or its --no- form); 1: NAME VALUE; 2: NAME VALUE VALUE
    examples: frozenset[str]
    excludes: frozenset[str]
    negations: tuple[str, ...] = ()  # the --no- forms of a flag
    env: str | None = None  # the LLAMA_ARG_* variable that sets it (set_env)


def _skip(text: str, i: int) -> int:
    """The index after the string / character literal or comment starting at text[i]; i when none does."""
    c = text[i]
    if c in "\"'":
        j = i + 1
        while text[j] != c:
            j += 2 if text[j] == "\\" else 1
        return j + 1
    if text.startswith("//", i):
        return text.index("\n", i)
    if text.startswith("/*", i):
        return text.index("*/", i) + 2
    return i


def _close(text: str, i: int) -> int:
    """The index of the bracket that closes the one at text[i] (strings and comments skipped)."""
    depth = 0
    while True:
        j = _skip(text, i)
        if j != i:
            i = j
            continue
        if text[i] in "([{":
            depth += 1
        elif text[i] in ")]}":
            depth -= 1
            if depth == 0:
                return i
        i += 1


def _items(text: str) -> list[str]:
    """The top-level comma-separated items of a C++ argument list."""
    out: list[str] = []
    depth = start = i = 0
    while i < len(text):
        j = _skip(text, i)
        if j != i:
            i = j
            continue
        if text[i] in "([{":
            depth += 1
        elif text[i] in ")]}":
            depth -= 1
        elif text[i] == "," and depth == 0:
            out.append(text[start:i].strip())
            start = i + 1
        i += 1
    out.append(text[start:].strip())
    return out


_C_STRING = re.compile(r'"([^"\\]*)"')


def _uncommented(text: str) -> str:
    """text without its comments (a note before the names of an option may quote other options)."""
    out: list[str] = []
    i = 0
    while i < len(text):
        j = _skip(text, i)
        if j == i:
            out.append(text[i])
            i += 1
            continue
        if text[i] in "\"'":
            out.append(text[i:j])
        i = j
    return "".join(out)
_SET_CALL = re.compile(r"\.set_(examples|excludes)\(\s*(\{[^}]*\}|\w+)\s*\)")
_SET_ENV = re.compile(r'\.set_env\(\s*"(\w+)"\s*\)')
_EXAMPLE_LIST = re.compile(r"std::initializer_list<enum llama_example>\s+(\w+)\s*=\s*\{([^}]*)\}")


def parse_arg_cpp(text: str) -> list[ArgCppOption]:
    """Every option arg.cpp adds (``add_opt(common_arg(...))``), in file order.

    common_arg's constructors (arg.h) tell the kind by their arguments before the handler:
    ``{names}, help`` a flag; ``{names}, {negations}, help`` a flag and its negation; ``{names},
    "HINT", help`` one value; ``{names}, "HINT", "HINT2", help`` two."""
    lists = {name: frozenset(x.strip() for x in body.split(",") if x.strip())
             for name, body in _EXAMPLE_LIST.findall(text)}
    out: list[ArgCppOption] = []
    for m in re.finditer(r"add_opt\(\s*common_arg\(", text):
        outer, inner = m.start() + len("add_opt"), m.end() - 1
        end_inner, end_outer = _close(text, inner), _close(text, outer)
        items = _items(text[inner + 1 : end_inner])
        k = next(i for i, it in enumerate(items) if it.startswith("["))  # the handler, a lambda
        items[:k] = [_uncommented(it).strip() for it in items[:k]]
        names = tuple(_C_STRING.findall(items[0]))
        negations: tuple[str, ...] = ()
        n_values = 0
        if k == 3 and items[1].startswith("{"):
            negations = tuple(_C_STRING.findall(items[1]))
        elif k >= 3:
            n_values = k - 2
        chain = text[end_inner + 1 : end_outer]
        sets = {"examples": frozenset({"LLAMA_EXAMPLE_COMMON"}), "excludes": frozenset[str]()}
        for kind, arg in _SET_CALL.findall(chain):
            sets[kind] = (frozenset(x.strip() for x in arg.strip("{}").split(",") if x.strip())
                          if arg.startswith("{") else lists[arg])
        env = _SET_ENV.search(chain)
        out.append(ArgCppOption(names, n_values, sets["examples"], sets["excludes"], negations,
                                env.group(1) if env else None))
    return out


def _for_server(o: ArgCppOption) -> bool:
    # common_params_parser_init's test for LLAMA_EXAMPLE_SERVER: in the example or common, and not excluded
    return bool({"LLAMA_EXAMPLE_SERVER", "LLAMA_EXAMPLE_COMMON"} & o.examples) \
        and "LLAMA_EXAMPLE_SERVER" not in o.excludes


def table_lines(options: Sequence[ArgCppOption]) -> list[str]:
    """llama-server's options as LLAMA_SERVER_OPTIONS' text holds them: the number of values, the names,
    each negation after a '!', the environment variable after 'env='."""
    lines: list[str] = []
    for o in filter(_for_server, options):
        line = " ".join([str(o.n_values), *o.names, *("!" + n for n in o.negations),
                         *([f"env={o.env}"] if o.env else [])])
        if line not in lines:  # -np is declared twice (one form for the server)
            lines.append(line)
    return lines


def server_options(options: Sequence[ArgCppOption]) -> dict[str, int]:
    """{name: number of values} of the options llama-server takes, negations included."""
    out: dict[str, int] = {}
    for o in filter(_for_server, options):
        out.update(dict.fromkeys(o.names + o.negations, o.n_values))
    return out


def _table(text: str) -> tuple[dict[str, int], dict[str, tuple[str, str | None, int]]]:
    """(name -> number of values, env variable -> (name, negation or None, number of values))."""
    names: dict[str, int] = {}
    envs: dict[str, tuple[str, str | None, int]] = {}
    for line in text.strip().splitlines():
        n, *words = line.split()
        pos = [w for w in words if not w.startswith(("!", "env="))]
        neg = [w[1:] for w in words if w.startswith("!")]
        names.update(dict.fromkeys(pos + neg, int(n)))
        for w in words:
            if w.startswith("env="):
                long = next((x for x in pos if x.startswith("--")), pos[0])
                envs[w[4:]] = (long, next((x for x in neg if x.startswith("--")), neg[0]) if neg else None, int(n))
    return names, envs


# llama-server's options at the pinned revision: number of values, then the names of one option (its
# negations included). Made by server_options(parse_arg_cpp(arg.cpp)); tests/test_serve_args.py
# compares it with the vendored file, so a revision bump that adds an option fails there first.
LLAMA_SERVER_OPTIONS, LLAMA_SERVER_ENV = _table("""
0 -h --help --usage
0 --version
0 -cl --cache-list
0 --completion-bash
1 -t --threads env=LLAMA_ARG_THREADS
1 -tb --threads-batch
1 -C --cpu-mask
1 -Cr --cpu-range
1 --cpu-strict
1 --prio
1 --poll
1 -Cb --cpu-mask-batch
1 -Crb --cpu-range-batch
1 --cpu-strict-batch
1 --prio-batch
1 --poll-batch
1 -lcs --lookup-cache-static
1 -lcd --lookup-cache-dynamic
1 -c --ctx-size env=LLAMA_ARG_CTX_SIZE
1 --kv-unified-per-slot env=LLAMA_ARG_KV_UNIFIED_PER_SLOT
1 -n --predict --n-predict env=LLAMA_ARG_N_PREDICT
1 -b --batch-size env=LLAMA_ARG_BATCH
1 -ub --ubatch-size env=LLAMA_ARG_UBATCH
1 --keep
0 --swa-full env=LLAMA_ARG_SWA_FULL
1 -ctxcp --ctx-checkpoints --swa-checkpoints env=LLAMA_ARG_CTX_CHECKPOINTS
1 -cms --checkpoint-min-step env=LLAMA_ARG_CHECKPOINT_MIN_SPACING_NT
1 -cram --cache-ram env=LLAMA_ARG_CACHE_RAM
0 -kvu --kv-unified !-no-kvu !--no-kv-unified env=LLAMA_ARG_KV_UNIFIED
0 --cache-idle-slots !--no-cache-idle-slots env=LLAMA_ARG_CACHE_IDLE_SLOTS
0 --context-shift !--no-context-shift env=LLAMA_ARG_CONTEXT_SHIFT
1 -fa --flash-attn env=LLAMA_ARG_FLASH_ATTN
0 --perf !--no-perf env=LLAMA_ARG_PERF
0 -e --escape !--no-escape
1 -r --reverse-prompt
0 -sp --special
0 --warmup !--no-warmup
0 --spm-infill
1 --samplers
1 -s --seed
1 --sampler-seq --sampling-seq
0 --ignore-eos
1 --temp --temperature env=LLAMA_ARG_TEMPERATURE
1 --top-k env=LLAMA_ARG_TOP_K
1 --top-p env=LLAMA_ARG_TOP_P
1 --min-p env=LLAMA_ARG_MIN_P
1 --top-nsigma --top-n-sigma
1 --xtc-probability
1 --xtc-threshold
1 --typical --typical-p
1 --repeat-last-n
1 --repeat-penalty env=LLAMA_ARG_REPEAT_PENALTY
1 --presence-penalty env=LLAMA_ARG_PRESENCE_PENALTY
1 --frequency-penalty env=LLAMA_ARG_FREQUENCY_PENALTY
1 --dry-multiplier
1 --dry-base
1 --dry-allowed-length
1 --dry-penalty-last-n
1 --dry-sequence-breaker
1 --adaptive-target
1 --adaptive-decay
1 --dynatemp-range
1 --dynatemp-exp
1 --mirostat
1 --mirostat-lr
1 --mirostat-ent
1 -l --logit-bias
1 --grammar
1 --grammar-file
1 -j --json-schema
1 -jf --json-schema-file
0 -bs --backend-sampling env=LLAMA_ARG_BACKEND_SAMPLING
1 --pooling env=LLAMA_ARG_POOLING
1 --rope-scaling env=LLAMA_ARG_ROPE_SCALING_TYPE
1 --rope-scale env=LLAMA_ARG_ROPE_SCALE
1 --rope-freq-base env=LLAMA_ARG_ROPE_FREQ_BASE
1 --rope-freq-scale env=LLAMA_ARG_ROPE_FREQ_SCALE
1 --yarn-orig-ctx env=LLAMA_ARG_YARN_ORIG_CTX
1 --yarn-ext-factor env=LLAMA_ARG_YARN_EXT_FACTOR
1 --yarn-attn-factor env=LLAMA_ARG_YARN_ATTN_FACTOR
1 --yarn-beta-slow env=LLAMA_ARG_YARN_BETA_SLOW
1 --yarn-beta-fast env=LLAMA_ARG_YARN_BETA_FAST
0 -kvo --kv-offload !-nkvo !--no-kv-offload env=LLAMA_ARG_KV_OFFLOAD
0 --repack !-nr !--no-repack env=LLAMA_ARG_REPACK
0 --no-host env=LLAMA_ARG_NO_HOST
1 -ctk --cache-type-k env=LLAMA_ARG_CACHE_TYPE_K
1 -ctv --cache-type-v env=LLAMA_ARG_CACHE_TYPE_V
1 -dt --defrag-thold env=LLAMA_ARG_DEFRAG_THOLD
1 -np --parallel env=LLAMA_ARG_N_PARALLEL
0 -cb --cont-batching !-nocb !--no-cont-batching env=LLAMA_ARG_CONT_BATCHING
1 -mm --mmproj env=LLAMA_ARG_MMPROJ
1 -mmu --mmproj-url env=LLAMA_ARG_MMPROJ_URL
0 --mmproj-auto !--no-mmproj !--no-mmproj-auto env=LLAMA_ARG_MMPROJ_AUTO
0 --mmproj-offload !--no-mmproj-offload env=LLAMA_ARG_MMPROJ_OFFLOAD
1 -mmdev --mmproj-device env=MTMD_BACKEND_DEVICE
1 --image-min-tokens env=LLAMA_ARG_IMAGE_MIN_TOKENS
1 --image-max-tokens env=LLAMA_ARG_IMAGE_MAX_TOKENS
1 --mtmd-batch-max-tokens env=LLAMA_ARG_MTMD_BATCH_MAX_TOKENS
1 --video-fps env=LLAMA_ARG_VIDEO_FPS
1 --video-timestamp-interval env=LLAMA_ARG_VIDEO_TIMESTAMP_INTERVAL
1 --video-ffmpeg-dir env=LLAMA_ARG_VIDEO_FFMPEG_DIR
1 --rpc env=LLAMA_ARG_RPC
1 -lm --load-mode env=LLAMA_ARG_LOAD_MODE
1 -lzm --lazy-mode env=LLAMA_ARG_LAZY_MODE
1 --numa env=LLAMA_ARG_NUMA
1 -dev --device env=LLAMA_ARG_DEVICE
0 --list-devices
1 -ot --override-tensor env=LLAMA_ARG_OVERRIDE_TENSOR
0 -cmoe --cpu-moe env=LLAMA_ARG_CPU_MOE
1 -ncmoe --n-cpu-moe env=LLAMA_ARG_N_CPU_MOE
1 -ncffn --n-cpu-ffn env=LLAMA_ARG_N_CPU_FFN
1 -ngl --gpu-layers --n-gpu-layers env=LLAMA_ARG_N_GPU_LAYERS
1 -sm --split-mode env=LLAMA_ARG_SPLIT_MODE
1 -ts --tensor-split env=LLAMA_ARG_TENSOR_SPLIT
1 -mg --main-gpu env=LLAMA_ARG_MAIN_GPU
1 -fit --fit env=LLAMA_ARG_FIT
1 -fitt --fit-target env=LLAMA_ARG_FIT_TARGET
1 -fitc --fit-ctx env=LLAMA_ARG_FIT_CTX
0 --check-tensors
1 --override-kv
0 --op-offload !--no-op-offload
1 --lora
1 --lora-scaled
1 --control-vector
1 --control-vector-scaled
2 --control-vector-layer-range
1 -a --alias env=LLAMA_ARG_ALIAS
1 --tags env=LLAMA_ARG_TAGS
1 -m --model env=LLAMA_ARG_MODEL
1 -mu --model-url env=LLAMA_ARG_MODEL_URL
1 -dr --docker-repo env=LLAMA_ARG_DOCKER_REPO
1 -hf -hfr --hf-repo env=LLAMA_ARG_HF_REPO
1 -hff --hf-file env=LLAMA_ARG_HF_FILE
1 -hft --hf-token env=HF_TOKEN
1 --embd-normalize
1 --host env=LLAMA_ARG_HOST
1 --port env=LLAMA_ARG_PORT
0 --reuse-port env=LLAMA_ARG_REUSE_PORT
1 --path env=LLAMA_ARG_STATIC_PATH
1 --cors-origins env=LLAMA_ARG_CORS_ORIGINS
1 --cors-methods env=LLAMA_ARG_CORS_METHODS
1 --cors-headers env=LLAMA_ARG_CORS_HEADERS
0 --cors-credentials !--no-cors-credentials env=LLAMA_ARG_CORS_CREDENTIALS
1 --api-prefix env=LLAMA_ARG_API_PREFIX
1 --ui-config --webui-config env=LLAMA_ARG_UI_CONFIG
1 --ui-config-file --webui-config-file env=LLAMA_ARG_UI_CONFIG_FILE
0 --ui-mcp-proxy --webui-mcp-proxy !--no-ui-mcp-proxy !--no-webui-mcp-proxy env=LLAMA_ARG_UI_MCP_PROXY
1 --tools env=LLAMA_ARG_TOOLS
1 --tools-runtime env=LLAMA_ARG_TOOLS_RUNTIME
1 --mcp-servers-config env=LLAMA_ARG_MCP_SERVERS_CONFIG
1 --mcp-servers-json env=LLAMA_ARG_MCP_SERVERS_JSON
0 -ag --agent !-no-ag !--no-agent env=LLAMA_ARG_AGENT
0 --ui --webui !--no-ui !--no-webui env=LLAMA_ARG_UI
0 --embedding --embeddings env=LLAMA_ARG_EMBEDDINGS
0 --rerank --reranking env=LLAMA_ARG_RERANKING
1 --api-key env=LLAMA_API_KEY
1 --api-key-file env=LLAMA_ARG_API_KEY_FILE
1 --ssl-key-file env=LLAMA_ARG_SSL_KEY_FILE
1 --ssl-cert-file env=LLAMA_ARG_SSL_CERT_FILE
1 --chat-template-kwargs env=LLAMA_ARG_CHAT_TEMPLATE_KWARGS
1 -to --timeout env=LLAMA_ARG_TIMEOUT
1 --sse-ping-interval env=LLAMA_ARG_SSE_PING_INTERVAL
1 --threads-http env=LLAMA_ARG_THREADS_HTTP
0 --cache-prompt !--no-cache-prompt env=LLAMA_ARG_CACHE_PROMPT
1 --cache-reuse env=LLAMA_ARG_CACHE_REUSE
0 --metrics env=LLAMA_ARG_ENDPOINT_METRICS
0 --props env=LLAMA_ARG_ENDPOINT_PROPS
0 --slots !--no-slots env=LLAMA_ARG_ENDPOINT_SLOTS
1 --slot-save-path
1 --media-path
1 --models-dir env=LLAMA_ARG_MODELS_DIR
1 --models-preset env=LLAMA_ARG_MODELS_PRESET
1 --models-max env=LLAMA_ARG_MODELS_MAX
0 --models-autoload !--no-models-autoload env=LLAMA_ARG_MODELS_AUTOLOAD
0 --jinja !--no-jinja env=LLAMA_ARG_JINJA
1 --reasoning-format env=LLAMA_ARG_THINK
1 -rea --reasoning env=LLAMA_ARG_REASONING
1 --reasoning-effort env=LLAMA_ARG_REASONING_EFFORT
1 --reasoning-budget env=LLAMA_ARG_THINK_BUDGET
1 --reasoning-budget-message env=LLAMA_ARG_THINK_BUDGET_MESSAGE
0 --reasoning-preserve !--no-reasoning-preserve env=LLAMA_ARG_REASONING_PRESERVE
1 --chat-template env=LLAMA_ARG_CHAT_TEMPLATE
1 --chat-template-file env=LLAMA_ARG_CHAT_TEMPLATE_FILE
0 --skip-chat-parsing !--no-skip-chat-parsing env=LLAMA_ARG_SKIP_CHAT_PARSING
0 --prefill-assistant !--no-prefill-assistant env=LLAMA_ARG_PREFILL_ASSISTANT
1 -sps --slot-prompt-similarity
0 --lora-init-without-apply
1 --sleep-idle-seconds
0 --log-disable
1 --log-file env=LLAMA_ARG_LOG_FILE
0 --log-jsonl !--no-log-jsonl env=LLAMA_ARG_LOG_JSONL
1 --log-prompts-dir
1 --log-colors env=LLAMA_ARG_LOG_COLORS
0 -v --verbose --log-verbose
0 --offline env=LLAMA_ARG_OFFLINE
1 -lv --verbosity --log-verbosity env=LLAMA_ARG_LOG_VERBOSITY
0 --log-prefix !--no-log-prefix env=LLAMA_ARG_LOG_PREFIX
0 --log-timestamps !--no-log-timestamps env=LLAMA_ARG_LOG_TIMESTAMPS
1 --spec-draft-hf -hfd -hfrd --hf-repo-draft env=LLAMA_ARG_SPEC_DRAFT_HF_REPO
1 --spec-draft-threads -td --threads-draft
1 --spec-draft-threads-batch -tbd --threads-batch-draft
1 --spec-draft-cpu-mask -Cd --cpu-mask-draft
1 --spec-draft-cpu-range -Crd --cpu-range-draft
1 --spec-draft-cpu-strict --cpu-strict-draft
1 --spec-draft-prio --prio-draft
1 --spec-draft-poll --poll-draft
1 --spec-draft-cpu-mask-batch -Cbd --cpu-mask-batch-draft
1 --spec-draft-cpu-strict-batch --cpu-strict-batch-draft
1 --spec-draft-prio-batch --prio-batch-draft
1 --spec-draft-poll-batch --poll-batch-draft
1 --spec-draft-type-k -ctkd --cache-type-k-draft env=LLAMA_ARG_SPEC_DRAFT_CACHE_TYPE_K
1 --spec-draft-type-v -ctvd --cache-type-v-draft env=LLAMA_ARG_SPEC_DRAFT_CACHE_TYPE_V
1 --spec-draft-override-tensor -otd --override-tensor-draft
0 --spec-draft-cpu-moe -cmoed --cpu-moe-draft env=LLAMA_ARG_SPEC_DRAFT_CPU_MOE
1 --spec-draft-n-cpu-moe --spec-draft-ncmoe -ncmoed --n-cpu-moe-draft env=LLAMA_ARG_SPEC_DRAFT_N_CPU_MOE
1 --spec-draft-n-max env=LLAMA_ARG_SPEC_DRAFT_N_MAX
1 --spec-draft-n-min env=LLAMA_ARG_SPEC_DRAFT_N_MIN
1 --spec-synth-len env=LLAMA_ARG_SPEC_SYNTH_LEN
1 --spec-synth-rates env=LLAMA_ARG_SPEC_SYNTH_RATES
1 --spec-draft-p-split --draft-p-split env=LLAMA_ARG_SPEC_DRAFT_P_SPLIT
1 --spec-draft-p-min --draft-p-min env=LLAMA_ARG_SPEC_DRAFT_P_MIN
0 --spec-draft-backend-sampling !--no-spec-draft-backend-sampling env=LLAMA_ARG_SPEC_DRAFT_BACKEND_SAMPLING
1 --spec-draft-device -devd --device-draft
1 --spec-draft-ngl -ngld --gpu-layers-draft --n-gpu-layers-draft env=LLAMA_ARG_N_GPU_LAYERS_DRAFT
1 --spec-draft-model -md --model-draft env=LLAMA_ARG_SPEC_DRAFT_MODEL
1 --spec-type env=LLAMA_ARG_SPEC_TYPE
1 --spec-ngram-mod-n-min
1 --spec-ngram-mod-n-max
1 --spec-ngram-mod-n-match
1 --spec-ngram-simple-size-n
1 --spec-ngram-simple-size-m
1 --spec-ngram-simple-min-hits
1 --spec-ngram-map-k-size-n
1 --spec-ngram-map-k-size-m
1 --spec-ngram-map-k-min-hits
1 --spec-ngram-map-k4v-size-n
1 --spec-ngram-map-k4v-size-m
1 --spec-ngram-map-k4v-min-hits
1 --draft --draft-n --draft-max env=LLAMA_ARG_DRAFT_MAX
1 --draft-min --draft-n-min env=LLAMA_ARG_DRAFT_MIN
1 --spec-ngram-size-n
1 --spec-ngram-size-m
1 --spec-ngram-min-hits
0 --embd-gemma-default
0 --fim-qwen-1.5b-default
0 --fim-qwen-3b-default
0 --fim-qwen-7b-default
0 --fim-qwen-7b-spec
0 --fim-qwen-14b-spec
0 --fim-qwen-30b-default
0 --gpt-oss-20b-default
0 --gpt-oss-120b-default
0 --vision-gemma-4b-default
0 --vision-gemma-12b-default
0 --spec-default
""")


# --------------------------------------------------------------------------- what maps to pyspec


@dataclasses.dataclass(frozen=True)
class Mapped:
    """A llama-server option pyspec applies: its names, the argparse dest, and how its value reads."""

    names: tuple[str, ...]
    dest: str
    type: Callable[[str], Any] | None = None  # None: a flag (store_const ``const``)
    const: Any = True
    help: str = argparse.SUPPRESS
    append: bool = False


def _flash_attn(value: str) -> str:
    # arg.cpp's is_truthy / is_falsey / is_autoy
    v = value.lower()
    if v in ("on", "enabled", "true", "1"):
        return "enabled"
    if v in ("off", "disabled", "false", "0"):
        return "disabled"
    if v in ("auto", "-1"):
        return "auto"
    raise argparse.ArgumentTypeError(f"unknown value for --flash-attn: {value!r} (on, off or auto)")


def _choice(option: str, choices: Sequence[str]) -> Callable[[str], str]:
    def conv(value: str) -> str:
        if value not in choices:
            raise argparse.ArgumentTypeError(f"invalid value for {option}: {value!r} ({', '.join(choices)})")
        return value
    return conv


# arg.cpp's --load-mode / --lazy-mode values (Model's load_mode / lazy_mode take the same names)
_load_mode = _choice("--load-mode", ("auto", "none", "mmap", "mlock", "mmap+mlock", "dio"))
_lazy_mode = _choice("--lazy-mode", ("on", "auto", "off"))

_KV_CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")  # arg.cpp kv_cache_types


def _stod(option: str, text: str) -> float:
    # arg.cpp reads these with std::stod on the stripped text and refuses trailing characters
    t = text.strip()
    try:
        if "_" in t:  # Python's float takes digit separators, std::stod does not
            raise ValueError(t)
        return float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid value for {option}: {text!r}") from None


def _synth_len(value: str) -> float:
    length = _stod("--spec-synth-len", value)
    if length == -1.0:  # -1 is the "not set" value, refused as arg.cpp refuses it
        raise argparse.ArgumentTypeError(f"invalid value for --spec-synth-len: {value!r}")
    return length


def _synth_rates(value: str) -> list[float]:
    return [_stod("--spec-synth-rates", part) for part in value.split(",")]


def _cache_type(value: str) -> str:
    if value.lower() not in _KV_CACHE_TYPES:
        raise argparse.ArgumentTypeError(f"unsupported cache type {value!r} (one of {', '.join(_KV_CACHE_TYPES)})")
    return value.lower()


def _gpu_layers(value: str) -> int:
    # llama-server: a number, 'auto' or 'all'; pyspec's -1 offloads every layer
    if value in ("auto", "all"):
        return -1
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--n-gpu-layers takes a number, 'auto' or 'all', not {value!r}") from None


_MAX_CPUS = 512  # GGML_MAX_N_THREADS: the length of common_cpu_params' cpumask
# ggml_sched_priority's values (--prio N) -> ThreadPool's names (tests/test_serve_args.py checks them with ggml's)
PRIORITY_NAMES = {-1: "low", 0: "normal", 1: "medium", 2: "high", 3: "realtime"}


def _int(option: str, text: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid value for {option}: {text!r} (an integer)") from None


def _cpu_mask(option: str) -> Callable[[str], frozenset[int]]:
    """common.cpp's parse_cpu_mask: hexadecimal, an optional 0x, the last digit CPUs 0-3 (at most 128
    digits read); the CPUs it sets."""
    def conv(text: str) -> frozenset[int]:
        digits = text[2:] if text.startswith("0x") else text
        digits = digits[:128]
        if any(c not in "0123456789abcdefABCDEF" for c in digits):
            raise argparse.ArgumentTypeError(f"invalid value for {option}: {text!r} (a hexadecimal CPU mask)")
        value = int(digits, 16) if digits else 0
        return frozenset(i for i in range(4 * len(digits)) if value >> i & 1)
    return conv


def _cpu_range(option: str) -> Callable[[str], frozenset[int]]:
    """common.cpp's parse_cpu_range: ``lo-hi`` (both included; no lo: 0, no hi: the last CPU ggml knows)."""
    def conv(text: str) -> frozenset[int]:
        m = re.fullmatch(r"([0-9]*)-([0-9]*)", text.strip())
        if m is None:
            raise argparse.ArgumentTypeError(f"invalid value for {option}: {text!r} (a CPU range lo-hi)")
        lo = int(m[1]) if m[1] else 0
        hi = int(m[2]) if m[2] else _MAX_CPUS - 1
        if lo >= _MAX_CPUS or hi >= _MAX_CPUS:
            raise argparse.ArgumentTypeError(f"invalid value for {option}: {text!r} (CPUs go up to {_MAX_CPUS - 1})")
        return frozenset(range(lo, hi + 1))
    return conv


def _prio(option: str, lowest: int) -> Callable[[str], str]:
    # arg.cpp: --prio takes low (-1) .. realtime (3), --prio-batch 0 .. 3
    def conv(text: str) -> str:
        n = _int(option, text)
        if not lowest <= n <= 3:
            raise argparse.ArgumentTypeError(f"invalid value for {option}: {text!r} ({lowest} .. 3)")
        return PRIORITY_NAMES[n]
    return conv


def _poll(option: str) -> Callable[[str], int]:
    def conv(text: str) -> int:
        n = _int(option, text)
        if not 0 <= n <= 100:
            raise argparse.ArgumentTypeError(f"invalid value for {option}: {text!r} (a polling level 0 .. 100)")
        return n
    return conv


def _strict(option: str) -> Callable[[str], bool]:
    return lambda text: _int(option, text) != 0  # arg.cpp: a number, any but 0 is strict


# the sampling defaults: llama-server's option -> CommonParamsSampling's field (pyspec serve's own
# --temp, --top-k, --top-p, --min-p and --seed stay where they are; these are read by resolve())
SAMPLING_FIELDS: dict[tuple[str, ...], tuple[str, Callable[[str], Any]]] = {
    ("--repeat-penalty",): ("penalty_repeat", float),
    ("--repeat-last-n",): ("penalty_last_n", int),
    ("--presence-penalty",): ("penalty_present", float),
    ("--frequency-penalty",): ("penalty_freq", float),
    ("--typical", "--typical-p"): ("typ_p", float),
    ("--top-nsigma", "--top-n-sigma"): ("top_n_sigma", float),
    ("--xtc-probability",): ("xtc_probability", float),
    ("--xtc-threshold",): ("xtc_threshold", float),
    ("--dynatemp-range",): ("dynatemp_range", float),
    ("--dynatemp-exp",): ("dynatemp_exponent", float),
    ("--mirostat",): ("mirostat", int),
    ("--mirostat-lr",): ("mirostat_eta", float),
    ("--mirostat-ent",): ("mirostat_tau", float),
    ("--dry-multiplier",): ("dry_multiplier", float),
    ("--dry-base",): ("dry_base", float),
    ("--dry-allowed-length",): ("dry_allowed_length", int),
    ("--dry-penalty-last-n",): ("dry_penalty_last_n", int),
}

# Every llama-server option that pyspec serve applies. A row's names that the serve parser already
# has (pyspec's own --model/-m, --threads/-t, --parallel/-np, --temp ...) keep their action; the
# others are added with the same dest, so e.g. --predict and --n-predict fill one value.
MAPPED: tuple[Mapped, ...] = (
    Mapped(("-m", "--model"), "model", str),
    Mapped(("-md", "--model-draft", "--spec-draft-model"), "draft", str),
    Mapped(("-c", "--ctx-size"), "ctx_size", int,
           help="llama-server's context size: the total over the slots, each slot gets N / --parallel "
                "(0: the model's training context; pyspec's --n-ctx is per slot)"),
    Mapped(("-b", "--batch-size"), "n_batch", int),
    Mapped(("-ub", "--ubatch-size"), "n_ubatch", int, help="physical batch size (default: --batch-size)"),
    Mapped(("-t", "--threads"), "threads", int),
    Mapped(("-tb", "--threads-batch"), "threads_batch", int,
           help="threads of batches and prompts (default: --threads; <= 0: every core)"),
    # the threadpools (common_cpu_params): -C and -Cr add to one mask, as llama-server's do
    Mapped(("-C", "--cpu-mask"), "cpu_mask", _cpu_mask("-C/--cpu-mask"), append=True,
           help="CPUs the threads may run on, a hexadecimal mask (adds to --cpu-range)"),
    Mapped(("-Cr", "--cpu-range"), "cpu_mask", _cpu_range("-Cr/--cpu-range"), append=True,
           help="CPUs the threads may run on, lo-hi (adds to --cpu-mask)"),
    Mapped(("--cpu-strict",), "cpu_strict", _strict("--cpu-strict"), help="1: one thread per CPU of the mask"),
    Mapped(("--prio",), "prio", _prio("--prio", -1),
           help="thread priority: -1 low, 0 normal, 1 medium, 2 high, 3 realtime"),
    Mapped(("--poll",), "poll", _poll("--poll"), help="how long idle threads poll for work, 0 .. 100 (default 50)"),
    Mapped(("-Cb", "--cpu-mask-batch"), "cpu_mask_batch", _cpu_mask("-Cb/--cpu-mask-batch"), append=True,
           help="as --cpu-mask, for batches (with -tb only, as in llama-server)"),
    Mapped(("-Crb", "--cpu-range-batch"), "cpu_mask_batch", _cpu_range("-Crb/--cpu-range-batch"), append=True,
           help="as --cpu-range, for batches (with -tb only)"),
    Mapped(("--cpu-strict-batch",), "cpu_strict_batch", _strict("--cpu-strict-batch"),
           help="as --cpu-strict, for batches (with -tb only)"),
    Mapped(("--prio-batch",), "prio_batch", _prio("--prio-batch", 0),
           help="as --prio (0 .. 3), for batches (with -tb only)"),
    Mapped(("--poll-batch",), "poll_batch", _poll("--poll-batch"), help="as --poll, for batches (with -tb only)"),
    Mapped(("-np", "--parallel"), "parallel", int),
    Mapped(("-fa", "--flash-attn"), "flash_attn", _flash_attn, help="flash attention: on, off or auto"),
    Mapped(("-ctk", "--cache-type-k"), "cache_type_k", _cache_type, help="K cache type (f16, q8_0, ...)"),
    Mapped(("-ctv", "--cache-type-v"), "cache_type_v", _cache_type, help="V cache type (f16, q8_0, ...)"),
    Mapped(("-kvu", "--kv-unified"), "kv_unified", None, True, help="one KV buffer shared by all slots"),
    Mapped(("-no-kvu", "--no-kv-unified"), "kv_unified", None, False),
    Mapped(("-ngl", "--gpu-layers", "--n-gpu-layers"), "n_gpu_layers", _gpu_layers),
    Mapped(("-ngld", "--gpu-layers-draft", "--n-gpu-layers-draft", "--spec-draft-ngl"), "draft_n_gpu_layers",
           _gpu_layers, help="layers of the draft model on the offload devices (default: as -ngl)"),
    Mapped(("-dev", "--device"), "device", str),
    Mapped(("-devd", "--device-draft", "--spec-draft-device"), "draft_device", str),
    Mapped(("--spec-type",), "spec_type", str, append=True,
           help="llama-server's speculative types (comma list; repeatable; pyspec's --types)"),
    Mapped(("--spec-draft-n-max", "--draft-max", "--draft-n"), "n_max", int),
    Mapped(("--spec-draft-n-min", "--draft-min", "--draft-n-min"), "n_min", int),
    Mapped(("--spec-draft-p-min", "--draft-p-min"), "p_min", float),
    Mapped(("--spec-synth-len",), "synth_len", _synth_len,
           help="target mean synthetic acceptance length, the target token included (benchmarking only)"),
    Mapped(("--spec-synth-rates",), "synth_rates", _synth_rates,
           help="per-position synthetic acceptance probabilities, a comma list (benchmarking only)"),
    # pyspec has one n-gram key size and one draft size for every n-gram type (spec_params)
    Mapped(("--spec-ngram-simple-size-n", "--spec-ngram-map-k-size-n", "--spec-ngram-map-k4v-size-n",
            "--spec-ngram-mod-n-match"), "ngram_n", int),
    Mapped(("--spec-ngram-simple-size-m", "--spec-ngram-map-k-size-m", "--spec-ngram-map-k4v-size-m",
            "--spec-ngram-mod-n-max"), "ngram_m", int),
    Mapped(("--chat-template",), "chat_template", str,
           help="chat template: a llama.cpp built-in name (chatml, llama3, ...) or a Jinja template text"),
    Mapped(("--chat-template-file",), "chat_template_file", str, help="chat template from a Jinja file"),
    Mapped(("--jinja",), "jinja", None, True),
    Mapped(("--no-jinja",), "jinja", None, False),
    Mapped(("--slot-save-path",), "slot_save_path", str),
    Mapped(("-sps", "--slot-prompt-similarity"), "slot_prompt_similarity", float),
    Mapped(("--cache-prompt",), "no_cache_prompt", None, False),
    Mapped(("--no-cache-prompt",), "no_cache_prompt", None, True),
    Mapped(("--api-key",), "api_key", str),
    Mapped(("--api-key-file",), "api_key_file", str, help="file of API keys, one per line"),
    Mapped(("-a", "--alias"), "alias", str),
    Mapped(("--tags",), "tags", str, help="model tags, a comma list (listed in /v1/models)"),
    Mapped(("-n", "--predict", "--n-predict"), "n_predict", int),
    Mapped(("--metrics",), "metrics", None, True, help="serve /metrics (Prometheus text format)"),
    Mapped(("--props",), "props", None, True),
    Mapped(("--slots",), "slots", None, True),
    Mapped(("--no-slots",), "slots", None, False, help="answer GET /slots with 501, as llama-server does"),
    Mapped(("--webui",), "webui", None, True),
    Mapped(("--no-webui",), "webui", None, False),
    Mapped(("-cb", "--cont-batching"), "cont_batching", None, True),
    Mapped(("-nocb", "--no-cont-batching"), "cont_batching", None, False),
    Mapped(("--context-shift",), "context_shift", None, True,
           help="a full slot drops half of what follows the kept tokens and goes on, instead of stopping"),
    Mapped(("--no-context-shift",), "context_shift", None, False),
    Mapped(("--keep",), "n_keep", int, help="tokens of the prompt a context shift keeps (-1: all of it; default 0)"),
    Mapped(("-s", "--seed"), "seed", int),
    Mapped(("--temp", "--temperature"), "temp", float),
    Mapped(("--top-k",), "top_k", int),
    Mapped(("--top-p",), "top_p", float),
    Mapped(("--min-p",), "min_p", float),
    Mapped(("--ignore-eos",), "ignore_eos", None, True),
    *(Mapped(names, "sampling_" + field, conv) for names, (field, conv) in SAMPLING_FIELDS.items()),
    Mapped(("-sm", "--split-mode"), "split_mode", str),
    Mapped(("-ts", "--tensor-split"), "tensor_split", str),
    Mapped(("-mg", "--main-gpu"), "main_gpu", int),
    Mapped(("--rpc",), "rpc", str),
    # at 0c1e57098 --load-mode replaces --mmap / --no-mmap / --mlock / --direct-io (Model(load_mode=))
    Mapped(("-lm", "--load-mode"), "load_mode", _load_mode, help="auto, none, mmap, mlock, mmap+mlock or dio"),
    Mapped(("-lzm", "--lazy-mode"), "lazy_mode", _lazy_mode, help="on-demand reads of large tensors: on, auto or off"),
    Mapped(("-v", "--verbose", "--log-verbose"), "serve_verbose", None, True),
    Mapped(("--embedding", "--embeddings"), "embedding", None, True,
           help="serve /embedding, /embeddings and /v1/embeddings (a context of the model with embeddings on)"),
    Mapped(("--pooling",), "pooling", _choice("--pooling", ("none", "mean", "cls", "last", "rank")),
           help="pooling of the embeddings: none, mean, cls or last (default: the model's)"),
    Mapped(("--embd-normalize",), "embd_normalize", int,
           help="normalisation of pooled embeddings: -1 none, 0 max absolute int16, 2 euclidean (default), p p-norm"),
    Mapped(("--cors-origins",), "cors_origins", str,
           help="allowed origins: * (default: any, the Origin echoed), localhost (only a local Origin echoed), "
                "or a value sent as it is"),
    Mapped(("--cors-methods",), "cors_methods", str, help="Access-Control-Allow-Methods of a preflight"),
    Mapped(("--cors-headers",), "cors_headers", str, help="Access-Control-Allow-Headers of a preflight"),
    Mapped(("--cors-credentials",), "cors_credentials", None, True),
    Mapped(("--no-cors-credentials",), "cors_credentials", None, False),
    Mapped(("--ui-mcp-proxy", "--webui-mcp-proxy"), "ui_mcp_proxy", None, True,
           help="relay /cors-proxy?url=... (llama-server's experimental CORS proxy for MCP servers)"),
    Mapped(("--no-ui-mcp-proxy", "--no-webui-mcp-proxy"), "ui_mcp_proxy", None, False),
    Mapped(("--spm-infill",), "spm_infill", None, True,
           help="/infill: suffix, prefix, middle instead of prefix, suffix, middle (as some models prefer)"),
    Mapped(("--host",), "host", str),
    Mapped(("--port",), "port", int),
)

# llama-server options that ask for something pyspec serve does not do (named in the one warning)
_NOT_DONE = {("jinja", False): "--no-jinja", ("webui", True): "--webui", ("cont_batching", False): "--no-cont-batching"}


def add_llama_server_args(parser: argparse.ArgumentParser) -> None:
    """Adds MAPPED's names that ``parser`` lacks (pyspec's own options stay as they are)."""
    known = set(parser._option_string_actions)  # argparse keeps no public list of option strings
    g = parser.add_argument_group("llama-server options (same names and meaning; see docs/server.md)")
    for m in MAPPED:
        names = [n for n in m.names if n not in known]
        if not names:
            continue
        kw: dict[str, Any] = {"dest": m.dest, "default": argparse.SUPPRESS, "help": m.help}
        if m.type is None:
            kw.update(action="store_const", const=m.const)
        else:
            kw.update(type=m.type, action="append" if m.append else "store")
        g.add_argument(*names, **kw)
        known.update(names)


# --------------------------------------------------------------------------- the command line


def _split(token: str) -> tuple[str, str | None]:
    """(option name, inline value) of ``--name=value``; llama.cpp reads ``--a_b`` as ``--a-b``."""
    name, eq, value = token.partition("=") if token.startswith("--") else (token, "", "")
    if name.startswith("--"):
        name = "--" + name[2:].replace("_", "-")
    return name, (value if eq else None)


_INT = re.compile(r"-?[0-9]+")


def filter_argv(argv: Sequence[str], parser: argparse.ArgumentParser) -> tuple[list[str], list[str]]:
    """``argv`` (serve's options) without the llama-server options ``parser`` does not know, each with
    its value(s); and the names dropped, for the one warning.

    Option names are read as llama.cpp reads them (``--ctx_size`` is ``--ctx-size``); an option's value
    is the next word whatever it looks like (``-ngl -1``). ``--draft N`` (a number: llama-server's old
    draft length) becomes ``--draft-max N``; ``--draft PATH`` stays pyspec's draft model. A word that is
    neither pyspec's nor llama-server's is left for argparse to refuse."""
    actions = parser._option_string_actions
    out: list[str] = []
    dropped: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        name, inline = _split(token)
        if name == "--draft" and inline is None and i + 1 < len(argv) and _INT.fullmatch(argv[i + 1]):
            name = "--draft-max"
        if name in actions:
            n = 0 if inline is not None else (1 if actions[name].nargs is None else 0)
            values = [inline] if inline is not None else list(argv[i + 1 : i + 1 + n])
            if actions[name].dest == "n_gpu_layers":  # llama-server's 'auto' / 'all' for pyspec's int option
                values = [str(_gpu_layers(v)) if v in ("auto", "all") else v for v in values]
            out.append(name if inline is None else f"{name}={values[0]}")
            out.extend(values if inline is None else [])
            i += 1 + n
        elif name in LLAMA_SERVER_OPTIONS:
            dropped.append(name)
            i += 1 + (0 if inline is not None else LLAMA_SERVER_OPTIONS[name])
        else:
            out.append(token)
            i += 1
    return out, dropped


_TRUTHY = ("on", "enabled", "true", "1")  # arg.cpp's is_truthy / is_falsey
_FALSEY = ("off", "disabled", "false", "0")


def env_argv(environ: Mapping[str, str]) -> list[str]:
    """The command-line words of llama-server's ``LLAMA_ARG_*`` variables set in ``environ``, to go
    before the command line's own (which win, as in llama-server): a value option takes the value; a
    flag is set by a truthy value; a flag with a negation follows the value, and ``LLAMA_ARG_NO_X``
    sets the negation (arg.cpp's get_value_from_env)."""
    out: list[str] = []
    for env, (name, negation, n_values) in LLAMA_SERVER_ENV.items():
        if negation is not None and env.replace("LLAMA_ARG_", "LLAMA_ARG_NO_", 1) in environ:
            out.append(negation)
            continue
        value = environ.get(env)
        if value is None:
            continue
        if n_values:
            out += [name, value]
        elif negation is not None and value.lower() in _FALSEY:
            out.append(negation)
        elif value.lower() in _TRUTHY:
            out.append(name)
    return out


# --------------------------------------------------------------------------- what cmd_serve gets


@dataclasses.dataclass
class ServeOptions:
    """The serve command line resolved: engine, context, model and server settings, and what is not applied."""

    n_ctx: int  # per slot (0: the model's training context, shared by the slots)
    n_batch: int
    n_ubatch: int | None
    parallel: int
    types: str
    spec_kw: dict[str, Any]
    context_kw: dict[str, Any]  # Context keywords (flash_attn_type, type_k, type_v, kv_unified)
    model_kw: dict[str, Any]  # Model keywords beyond the placement ones (load_mode, lazy_mode)
    draft_n_gpu_layers: int | None
    sampling_kw: dict[str, Any]  # CommonParamsSampling fields
    chat_template: str | None
    api_keys: list[str]
    model_alias: str | None  # the model's name: the first alias in sorted order, as llama-server's std::set
    model_aliases: list[str]
    model_tags: list[str]
    metrics: bool
    slots: bool
    props: bool  # POST /props accepted (llama-server's --props)
    embedding: bool  # serve the embedding endpoints (--embedding)
    pooling: str | None  # their pooling (None: the model's)
    embd_normalize: int
    cors: Any  # a pyspec.server.cors.CorsPolicy (llama-server's --cors-* options)
    cpuparams: Any  # the threadpools' CommonCpuParams (pyspec.common.common): generation
    cpuparams_batch: Any  # and batches (None: as cpuparams)
    context_shift: bool  # --context-shift: a full slot shifts instead of stopping
    n_keep: int  # --keep: what a context shift keeps of a request that does not say (-1: its prompt)
    not_applied: list[str]  # llama-server options accepted without effect, for the one warning


def _read(path: str, what: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise CliError(f"cannot read the {what} {path}: {e.strerror or e}") from None


_BATCH_ONLY = {"cpu_mask_batch": "-Cb/-Crb", "cpu_strict_batch": "--cpu-strict-batch", "prio_batch": "--prio-batch",
               "poll_batch": "--poll-batch"}


def _cpumask(g: Mapping[str, Any], dest: str, option: str) -> tuple[int, ...] | None:
    """The CPUs of the masks and ranges given (their union), those of this machine; None: no mask given."""
    if dest not in g:
        return None
    cpus = set().union(*g[dest])
    n_cpu = min(os.cpu_count() or 1, _MAX_CPUS)
    here = sorted(c for c in cpus if c < n_cpu)
    if not here:
        raise CliError(f"{option} name no CPU of this machine (CPUs 0 .. {n_cpu - 1})")
    if len(here) < len(cpus):  # llama-server's threads fail to pin there and run anywhere: keep the rest
        logging.getLogger("pyspec").warning("%s: CPUs %s are not on this machine (CPUs 0 .. %d); using %s", option,
                                            ",".join(map(str, sorted(cpus - set(here)))), n_cpu - 1,
                                            ",".join(map(str, here)))
    return tuple(here)


def _cpu_params(g: Mapping[str, Any]) -> tuple[Any, Any, int | None, list[str]]:
    """common_params' cpuparams and cpuparams_batch as arg.cpp and postprocess_cpu_params leave them: the
    generation pool from --cpu-mask / --cpu-range / --cpu-strict / --prio / --poll (its thread count the
    context's, from --threads); the batch pool a copy of it unless --threads-batch is given, then its own from
    the -batch options. Also the batch thread count (None: as --threads) and the -batch options that have no
    effect (given without --threads-batch, as in llama-server)."""
    from pyspec.common.common import COMMON_CPU_PARAMS_DEFAULT, CommonCpuParams

    def params(suffix: str, mask_option: str, n_threads: int) -> CommonCpuParams:
        if not any(k + suffix in g for k in ("cpu_mask", "cpu_strict", "prio", "poll")) and n_threads == -1:
            return COMMON_CPU_PARAMS_DEFAULT
        return CommonCpuParams(n_threads=n_threads, cpumask=_cpumask(g, "cpu_mask" + suffix, mask_option),
                               priority=g.get("prio" + suffix, "normal"),
                               strict_cpu=g.get("cpu_strict" + suffix, False), poll=g.get("poll" + suffix, 50))

    cpuparams = params("", "-C/--cpu-mask and -Cr/--cpu-range", -1)
    if "threads_batch" not in g:
        return cpuparams, None, None, [f"{name} (without -tb)" for dest, name in _BATCH_ONLY.items() if dest in g]
    n_batch = int(g["threads_batch"])
    if n_batch <= 0:  # arg.cpp: std::thread::hardware_concurrency()
        n_batch = os.cpu_count() or 1
    if n_batch > _MAX_CPUS:
        raise CliError(f"-tb/--threads-batch {n_batch} is more than ggml's {_MAX_CPUS} threads")
    return cpuparams, params("_batch", "-Cb/--cpu-mask-batch and -Crb/--cpu-range-batch", n_batch), n_batch, []


def resolve(args: argparse.Namespace, dropped: Sequence[str] = ()) -> ServeOptions:
    """The serve options from parsed ``args`` (pyspec's names and llama-server's) and the llama-server
    options :func:`filter_argv` dropped."""
    g = vars(args)
    not_applied = list(dict.fromkeys(dropped))
    parallel = int(g["parallel"])
    if parallel == -1:  # llama-server's auto: 4 slots (server.cpp)
        parallel = 4
    if parallel <= 0:
        raise CliError("--parallel must be positive (or -1: 4 slots)")
    if "ctx_size" in g:
        total = int(g["ctx_size"])
        if total < 0 or 0 < total < parallel:
            raise CliError(f"--ctx-size {total} leaves no context for each of {parallel} slots")
        n_ctx = total // parallel
    else:
        n_ctx = int(g["n_ctx"])
        if n_ctx <= 0:
            raise CliError("--n-ctx must be positive")
    if g["n_batch"] <= 0 or (g.get("n_ubatch") is not None and g["n_ubatch"] <= 0):
        raise CliError("--batch-size and --ubatch-size must be positive")

    types = str(g["types"])
    if g.get("spec_type"):
        from pyspec.generation.contexts import parse_types
        from pyspec.suffix.names import split_suffix_type

        types = ",".join(g["spec_type"])
        try:
            parse_types(split_suffix_type(types)[0])  # "suffix", pyspec's own type, as --types takes it
        except ValueError as e:
            raise CliError(f"--spec-type: {e}") from None
    if g.get("draft") and not g.get("spec_type") and types in ("none", ""):
        types = "draft-simple"  # a draft model given without a type: speculate with it, as asked
    spec_kw = {k: g.get(k) for k in ("n_max", "n_min", "p_min", "ngram_n", "ngram_m")}
    spec_kw.update({k: g[k] for k in ("synth_len", "synth_rates") if g.get(k) is not None})  # benchmarking only

    context_kw: dict[str, Any] = {}
    if "flash_attn" in g:
        context_kw["flash_attn_type"] = g["flash_attn"]
    for opt, key in (("cache_type_k", "type_k"), ("cache_type_v", "type_v"), ("kv_unified", "kv_unified")):
        if opt in g:
            context_kw[key] = g[opt]
    cpuparams, cpuparams_batch, threads_batch, unused = _cpu_params(g)
    if threads_batch is not None:
        context_kw["n_threads_batch"] = threads_batch
    not_applied += unused

    model_kw: dict[str, Any] = {k: g[k] for k in ("load_mode", "lazy_mode") if g.get(k) is not None}

    sampling_kw: dict[str, Any] = {k: g[k] for k in ("temp", "top_k", "top_p", "min_p")}
    seed = int(g["seed"])
    sampling_kw["seed"] = 0xFFFFFFFF if seed < 0 else seed  # llama-server's -1: random (LLAMA_DEFAULT_SEED)
    if g.get("ignore_eos"):
        sampling_kw["ignore_eos"] = True
    for _, (field, _conv) in SAMPLING_FIELDS.items():
        if "sampling_" + field in g:
            sampling_kw[field] = g["sampling_" + field]

    chat_template = g.get("chat_template")
    if g.get("chat_template_file"):
        chat_template = _read(g["chat_template_file"], "chat template file")

    keys = [k.strip() for k in (g.get("api_key") or "").split(",") if k.strip()]  # llama-server: a comma list
    if g.get("api_key_file"):
        keys += [line.strip() for line in _read(g["api_key_file"], "API key file").splitlines()
                 if line.strip() and not line.startswith("#")]

    # llama-server: comma lists, kept sorted (std::set); the first alias names the model
    aliases = sorted({a.strip() for a in (g.get("alias") or "").split(",") if a.strip()})
    tags = sorted({t.strip() for t in (g.get("tags") or "").split(",") if t.strip()})

    from pyspec.server.cors import CorsPolicy

    cors_kw: dict[str, Any] = {}
    for opt, key in (("cors_origins", "origins"), ("cors_methods", "methods"), ("cors_headers", "headers")):
        if opt in g:
            text = str(g[opt])
            if any(ord(c) < 0x20 or ord(c) == 0x7F for c in text):
                raise CliError(f"--{opt.replace('_', '-')} holds a control character: it goes into a header")
            cors_kw[key] = text
    if "cors_credentials" in g:
        cors_kw["credentials"] = bool(g["cors_credentials"])
    # arg.cpp: server tools or MCP servers make localhost the default origin
    if "origins" not in cors_kw and {"--tools", "--mcp-servers-config", "--mcp-servers-json"} & set(not_applied):
        cors_kw["origins"] = "localhost"

    n_keep = int(g.get("n_keep", 0))
    if n_keep < -1:
        raise CliError(f"--keep must be -1 (the whole prompt) or more, not {n_keep}")

    pooling = g.get("pooling")
    if pooling == "rank":  # reranking (llama-server's /rerank) is not served: embeddings pool by the model's choice
        not_applied.append("--pooling rank")
        pooling = None

    for (dest, value), name in _NOT_DONE.items():
        if dest in g and g[dest] == value:
            not_applied.append(name)
    return ServeOptions(
        n_ctx=n_ctx, n_batch=int(g["n_batch"]), n_ubatch=g.get("n_ubatch"), parallel=parallel, types=types,
        spec_kw=spec_kw, context_kw=context_kw, model_kw=model_kw, draft_n_gpu_layers=g.get("draft_n_gpu_layers"),
        sampling_kw=sampling_kw, chat_template=chat_template, api_keys=keys,
        model_alias=aliases[0] if aliases else None, model_aliases=aliases, model_tags=tags,
        metrics=bool(g.get("metrics", False)), slots=bool(g.get("slots", True)), props=bool(g.get("props", False)),
        embedding=bool(g.get("embedding", False)), pooling=pooling, embd_normalize=int(g.get("embd_normalize", 2)),
        cors=CorsPolicy(**cors_kw), cpuparams=cpuparams, cpuparams_batch=cpuparams_batch,
        context_shift=bool(g.get("context_shift", False)), n_keep=n_keep,
        not_applied=list(dict.fromkeys(not_applied)))
