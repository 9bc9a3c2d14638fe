target_sources(hspmd_lib PRIVATE plan.cc plan_json.cc dry_run.cc pipelines.cc)
