hspmd_test(test_models_config test_config.cc)
