#!/usr/bin/env bash
# Issue 20, part C: put modules in the rooms the layer order gives them (docs/design.md).
#
# Re-runnable on any tree of this repository (also a merged one): each `git mv` happens only
# while its source still exists, new package files are created only when absent, and the
# import rewrite is a sed of dotted module names over every tracked file under src tests
# benchmarks examples docs (CHANGELOG.md keeps the old names: it is history). Run it from the
# repository root; it stages the result, commit it yourself.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"

S=src/flowrl

move() { # move SRC DST: git mv when SRC is still there
    if [ -e "$1" ]; then
        mkdir -p "$(dirname "$2")"
        git mv "$1" "$2"
    fi
}

package() { # package DIR DOCSTRING: an __init__.py with that docstring, when absent
    if [ ! -e "$1/__init__.py" ]; then
        mkdir -p "$1"
        printf '"""%s"""\n' "$2" >"$1/__init__.py"
        git add "$1/__init__.py"
    fi
}

# Config and statistics structs: imported by the controller, journal and store, so they sit
# at the bottom with errors, not in the client.
move $S/_client/config.py $S/_config.py
# Batch is what a client's get() returns: it leaves the data plane for the client.
move $S/_store/batch.py $S/_client/batch.py
# _pipeline keeps declaring and running pipelines; the rest leaves it.
package $S/_weights "Weight sync between a trainer and rollout engines (no hub involved)."
move $S/_pipeline/weights.py $S/_weights/sync.py
move $S/_pipeline/weights_ray.py $S/_weights/object_store.py # the wsync branch's Ray pair
package $S/_observers "Observers of the hub's event stream that the package ships (fail-soft hooks)."
move $S/_pipeline/staleness.py $S/_observers/staleness.py
move $S/_pipeline/timeline.py $S/_observers/timeline.py
move $S/_pipeline/sched_hooks.py $S/sched_hooks.py
# Starting hub processes and Ray actors is launching, above the transport it starts.
package $S/_launch "Starting a hub: server processes on one machine, or Ray actors on a cluster."
move $S/_transport/launch.py $S/_launch/processes.py
move $S/_transport/ray_hub.py $S/_launch/ray_hub.py
move $S/_transport/ray_server.py $S/_launch/ray_server.py
move $S/_transport/serve.py $S/_launch/serve.py
move $S/_transport/specs.py $S/_launch/specs.py

# old dotted name -> new dotted name (also catches `python -m` strings and docs)
RENAMES=(
    "flowrl\._client\.config=flowrl._config"
    "flowrl\._store\.batch=flowrl._client.batch"
    "flowrl\._pipeline\.weights=flowrl._weights.sync"
    "flowrl\._pipeline\.weights_ray=flowrl._weights.object_store"
    "flowrl\._pipeline\.staleness=flowrl._observers.staleness"
    "flowrl\._pipeline\.timeline=flowrl._observers.timeline"
    "flowrl\._pipeline\.sched_hooks=flowrl.sched_hooks"
    "flowrl\._transport\.launch=flowrl._launch.processes"
    "flowrl\._transport\.ray_hub=flowrl._launch.ray_hub"
    "flowrl\._transport\.ray_server=flowrl._launch.ray_server"
    "flowrl\._transport\.serve=flowrl._launch.serve"
    "flowrl\._transport\.specs=flowrl._launch.specs"
)
script=()
pattern=""
for pair in "${RENAMES[@]}"; do
    old=${pair%%=*}
    new=${pair#*=}
    script+=(-e "s/${old}\b/${new}/g")
    pattern+="${pattern:+|}${old}\b"
done
git ls-files -z src tests benchmarks examples docs \
    | xargs -0 grep -lZE "$pattern" -- 2>/dev/null \
    | xargs -0 -r sed -i -E "${script[@]}" || true # grep finds nothing on a re-run
# the renamed imports may now sit out of order: let ruff re-sort them (isort rules only)
ruff check --quiet --select I --fix src tests benchmarks examples || true
git add -u src tests benchmarks examples docs
