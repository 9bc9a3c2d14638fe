target_sources(hspmd PRIVATE plan_cmd.cc)
