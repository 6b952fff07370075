"""Plugin examples in the shape of the Ark RL SDK's ``rl_demo`` template (imports changed).

``weather_rollout`` / ``async_weather_rollout``: a tool-calling agent loop;
``raw_rollout``: manual state with ``update_state_from_messages`` and
``process_completion``; ``group_rollout``: three Responses branches;
``random_reward``: a group grader; ``custom_advantage``: GRPO advantages computed in
the grader; ``weather_reward``: a grader that checks the answer; ``trainer``: a
trainer that reads the feed and drives pause, weight update and resume (the training loop).
"""
