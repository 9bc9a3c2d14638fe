target_sources(hspmd_lib PRIVATE plan.cc plan_json.cc dry_run.cc pipelines.cc switch.cc switch_state.cc)
