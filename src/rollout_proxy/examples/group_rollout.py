"""Group Rollout (the seed's example): three responses, two of them branches of the first."""

from __future__ import annotations

from rollout_proxy.sdk import (
    ChatCompletionSample,
    GroupRolloutResult,
    PluginContext,
    PluginInstance,
    PluginStatus,
    RolloutInferenceProxy,
    Runtime,
    SingleResponse,
    group_rollout,
)


@group_rollout(
    name="group_rollout",
    runtime=Runtime(
        instance=PluginInstance.CPU4MEM8,
        max_concurrency=100,
        min_replicas=1,
        max_replicas=10,
        timeout=900,
    ),
)
async def demo_group_rollout(
    context: PluginContext,
    proxy: RolloutInferenceProxy,
    sample: ChatCompletionSample,
    n_sample: int = 1,
) -> GroupRolloutResult:
    client = proxy.async_rollout_client()
    response_1 = await client.responses.create(
        model="doubao-seed-2-0-lite-260428",
        input=[{"role": "user", "content": "人之初"}],
    )
    response_2 = await client.responses.create(
        model="doubao-seed-2-0-lite-260428",
        input=[{"role": "user", "content": "性相近"}],
        previous_response_id=response_1.id,
    )
    response_3 = await client.responses.create(
        model="doubao-seed-2-0-lite-260428",
        input=[{"role": "user", "content": "苟不教"}],
        previous_response_id=response_1.id,
    )
    return GroupRolloutResult(
        status=PluginStatus.SUCCESS,
        responses=[
            SingleResponse(id=response_1.id),
            SingleResponse(id=response_2.id),
            SingleResponse(id=response_3.id, extra={"reward": 1.0}),
        ],
    )
