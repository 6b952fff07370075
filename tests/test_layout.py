"""Every module has a place where its tests live, so a reader finds them and a new module cannot go untested unseen.

A module ``src/rollout_proxy/<sub>/<stem>.py`` is tested in ``tests/<sub>/test_<stem>.py``; otherwise it is
listed here: in ``TESTED_IN`` with the test file that exercises it (through the module it belongs to, or
over HTTP), or in ``NO_LOGIC`` with why it needs no test file of its own. Cross-cutting scenarios live in
``tests/scenarios/``. The lists are checked both ways: an entry for a module that is gone, or pointing at
a file that is gone, fails too. Path-based only: nothing is imported.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "rollout_proxy"
TESTS = ROOT / "tests"

#: module (relative to src/rollout_proxy) -> the test file that really exercises it
TESTED_IN: dict[str, str] = {
    "app.py": "tests/proxy/test_openapi.py",
    "core/chat.py": "tests/proxy/test_chat_flow.py",
    "core/distill.py": "tests/core/test_teacher_pass.py",
    "core/messages.py": "tests/proxy/test_messages.py",
    "core/rendering.py": "tests/core/test_turn_logic.py",
    "core/responses.py": "tests/proxy/test_responses.py",
    "core/streaming.py": "tests/core/test_turn_logic.py",
    "core/trajectory.py": "tests/wire/test_trajectory.py",
    "core/turn_routing.py": "tests/routing/test_routing_flow.py",
    "embedded.py": "tests/runner/test_training_loop.py",
    "engines/base.py": "tests/engines/test_vllm_client.py",
    "engines/gate.py": "tests/engines/test_health.py",
    "engines/member.py": "tests/engines/test_control.py",
    "engines/shared.py": "tests/test_fleet_workers.py",
    "engines/streaming.py": "tests/engines/test_vllm_stream.py",
    "engines/vllm_http.py": "tests/engines/test_vllm_client.py",
    "errors.py": "tests/proxy/test_errors.py",
    "examples/async_weather_rollout.py": "tests/sdk/test_examples.py",
    "examples/codex_answer.py": "tests/devtools/test_demo.py",
    "examples/custom_advantage.py": "tests/sdk/test_examples.py",
    "examples/group_rollout.py": "tests/sdk/test_examples.py",
    "examples/image_answer.py": "tests/runner/test_image_answer_job.py",
    "examples/random_reward.py": "tests/sdk/test_examples.py",
    "examples/raw_rollout.py": "tests/sdk/test_examples.py",
    "examples/short_answer.py": "tests/runner/test_short_answer_job.py",
    "examples/swe_tests.py": "tests/runner/test_harness.py",
    "examples/trainer.py": "tests/runner/test_training_loop.py",
    "examples/weather_reward.py": "tests/sdk/test_tracing.py",
    "examples/weather_rollout.py": "tests/sdk/test_examples.py",
    "examples/weather_tool.py": "tests/sdk/test_examples.py",
    "proxy/anthropic_answers.py": "tests/proxy/test_messages.py",
    "proxy/anthropic_models.py": "tests/proxy/test_messages_errors.py",
    "proxy/auth.py": "tests/proxy/test_auth_edges.py",
    "proxy/handlers/chat.py": "tests/proxy/test_chat_flow.py",
    "proxy/handlers/common.py": "tests/proxy/test_rollout_export.py",
    "proxy/handlers/distill.py": "tests/core/test_teacher_pass.py",
    "proxy/handlers/docs.py": "tests/proxy/test_openapi.py",
    "proxy/handlers/feed.py": "tests/runner/test_feed.py",
    "proxy/handlers/messages.py": "tests/proxy/test_messages.py",
    "proxy/handlers/meta.py": "tests/scenarios/test_outages.py",
    "proxy/handlers/responses.py": "tests/proxy/test_responses.py",
    "proxy/handlers/sessions.py": "tests/proxy/test_atomicity.py",
    "proxy/handlers/trajectories.py": "tests/proxy/test_rollout_export.py",
    "proxy/handlers/turn.py": "tests/proxy/test_intake.py",
    "proxy/handlers/ui.py": "tests/ui/test_viewer_api.py",
    "proxy/handlers/viewer.py": "tests/ui/test_viewer_api.py",
    "proxy/http.py": "tests/proxy/test_http_edge.py",
    "proxy/input_models.py": "tests/proxy/test_resent_history.py",
    "proxy/limits.py": "tests/proxy/test_validation_models.py",
    "proxy/message_models.py": "tests/proxy/test_validation_models.py",
    "proxy/middleware.py": "tests/proxy/test_errors.py",
    "proxy/openai_responses.py": "tests/proxy/test_responses.py",
    "proxy/schemas.py": "tests/proxy/test_validation_models.py",
    "proxy/telemetry.py": "tests/test_metrics.py",
    "proxy/validation.py": "tests/proxy/test_validation_models.py",
    "proxy/workers.py": "tests/test_workers.py",
    "records.py": "tests/state/test_codec.py",
    "routing/alignment.py": "tests/routing/test_routing_units.py",
    "routing/engine_format.py": "tests/routing/test_routing_units.py",
    "routing/rows.py": "tests/routing/test_routing_units.py",
    "runner/distill.py": "tests/runner/test_opd.py",
    "runner/executor.py": "tests/runner/test_ray_executor.py",
    "runner/job.py": "tests/runner/test_job_file.py",
    "runner/settings.py": "tests/test_settings.py",
    "runner/plot.py": "tests/runner/test_summary_plot.py",
    "runner/plugins.py": "tests/runner/test_ray_executor.py",
    "runner/progress.py": "tests/runner/test_summary_plot.py",
    "runner/rollouts.py": "tests/runner/test_runner_e2e.py",
    "runner/runner.py": "tests/runner/test_job_file.py",
    "sdk/proxy.py": "tests/sdk/test_inference_proxy.py",
    "sdk/runtime.py": "tests/sdk/test_decorators.py",
    "sdk/types.py": "tests/sdk/test_local.py",
    "state/instrumented.py": "tests/test_metrics.py",
    "state/listing.py": "tests/state/test_store_listing.py",
    "state/memory.py": "tests/state/test_store_contract.py",
    "state/redis.py": "tests/state/test_redis_store.py",
    "state/redis_feed.py": "tests/runner/test_feed.py",
    "state/store.py": "tests/state/test_store_contract.py",
    "tokenization/parsers/base.py": "tests/tokenization/test_parsers.py",
    "tokenization/parsers/hermes.py": "tests/tokenization/test_parsers.py",
    "tokenization/parsers/incremental.py": "tests/tokenization/test_parsers_stream.py",
    "tokenization/parsers/think.py": "tests/tokenization/test_parsers.py",
    "tokenization/vllm_chat.py": "tests/tokenization/test_local.py",
    "tracing.py": "tests/test_tracing_server.py",
    "trainer/consumer.py": "tests/trainer/test_restarts.py",
    "trainer/fleet.py": "tests/trainer/test_fleet_driver.py",
    "trainer/loop.py": "tests/trainer/test_restarts.py",
    "trainer/plot.py": "tests/trainer/test_loop_fake.py",
    "trainer/settings.py": "tests/test_settings.py",
    "ui/assets.py": "tests/ui/test_viewer_api.py",
    "ui/grades.py": "tests/ui/test_pieces_and_grades.py",
    "ui/pieces.py": "tests/ui/test_pieces_and_grades.py",
    "ui/service.py": "tests/ui/test_viewer_api.py",
    "wire/anthropic.py": "tests/proxy/test_resent_history.py",
    "wire/feed.py": "tests/trainer/test_batch.py",
}

#: module -> why it needs no test file of its own
NO_LOGIC: dict[str, str] = {
    "engines/router.py": "a Protocol only; engines.fleet.Fleet implements it, tests/core/test_turn_logic.py drives a "
    "turn through a stand-in",
    "proxy/keys.py": "typed web.AppKeys only",
    "proxy/openapi_answers.py": "TypedDicts for the OpenAPI document; tests/proxy/test_openapi.py checks the document",
    "proxy/openapi_examples.py": "example request bodies; tests/proxy/test_fuzz.py sends each one",
    "wire/errors.py": "one exception class",
    "wire/generation.py": "the names of the pinned generation settings; tests/proxy/test_errors.py refuses them",
}


def module_paths() -> set[str]:
    return {
        path.relative_to(SRC).as_posix()
        for path in SRC.rglob("*.py")
        if path.name not in ("__init__.py", "__main__.py")
    }


def mirrored_test(module: str) -> Path:
    """``core/turns.py`` -> ``tests/core/test_turns.py``; ``ids.py`` -> ``tests/test_ids.py``."""
    path = Path(module)
    return TESTS / path.parent / f"test_{path.stem}.py"


def test_every_module_has_a_test_file_or_says_where_it_is_tested():
    untested = sorted(
        module
        for module in module_paths()
        if not mirrored_test(module).is_file() and module not in TESTED_IN and module not in NO_LOGIC
    )
    assert not untested, (
        "modules without tests/<subpackage>/test_<module>.py, nor an entry in TESTED_IN or NO_LOGIC "
        f"(tests/test_layout.py): {untested}"
    )


def test_the_mappings_name_modules_that_exist():
    modules = module_paths()
    gone = sorted((set(TESTED_IN) | set(NO_LOGIC)) - modules)
    assert not gone, f"TESTED_IN / NO_LOGIC name modules that no longer exist: {gone}"


def test_tested_in_points_at_test_files_that_exist():
    missing = sorted(
        f"{module} -> {target}"
        for module, target in TESTED_IN.items()
        if not ((ROOT / target).is_file() and Path(target).name.startswith("test_") and target.startswith("tests/"))
    )
    assert not missing, f"TESTED_IN points at test files that do not exist: {missing}"


def test_a_module_is_mapped_only_when_it_has_no_test_file_of_its_own():
    """Once ``tests/<sub>/test_<module>.py`` exists, the mapping entry is stale: it would hide where the tests are."""
    redundant = sorted(module for module in (set(TESTED_IN) | set(NO_LOGIC)) if mirrored_test(module).is_file())
    both = sorted(set(TESTED_IN) & set(NO_LOGIC))
    assert not redundant, f"modules with their own test file are still mapped: {redundant}"
    assert not both, f"modules both TESTED_IN and NO_LOGIC: {both}"


def test_a_modules_test_file_mirrors_its_path_under_tests():
    """Subpackages nest (``tokenization/parsers``); top-level modules are tested in ``tests/`` itself."""
    assert mirrored_test("state/keys.py") == TESTS / "state" / "test_keys.py"
    assert mirrored_test("ids.py") == TESTS / "test_ids.py"
    assert mirrored_test("tokenization/parsers/think.py") == TESTS / "tokenization" / "parsers" / "test_think.py"
    assert not mirrored_test("no_such/module.py").is_file()
