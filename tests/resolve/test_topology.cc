#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "hspmd/core/error.h"
#include "hspmd/resolve/topology.h"

namespace hspmd {
namespace {

using nlohmann::json;

// The paper's mixed cluster: 8 H800 (NVLink 400 GB/s) and 8 H20 (900 GB/s),
// 25 GB/s per device across nodes.
json mixed_cluster() {
  return json::parse(R"({
    "catalog": {
      "H800": {"tflops": 990, "memory_gib": 79.65, "intra_node_gbps": 400, "inter_node_gbps": 25},
      "H20":  {"tflops": 148, "memory_gib": 95.58, "intra_node_gbps": 900, "inter_node_gbps": 25}
    },
    "nodes": [
      {"type": "H800", "ranks": [0, 7]},
      {"type": "H20", "ranks": [8, 15], "slowdown": 2.0, "memory_cap_gib": 4}
    ]
  })");
}

void expect_error(const json& j, const std::string& fragment) {
  try {
    Topology::from_json(j);
    ADD_FAILURE() << "no error, expected: " << fragment;
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.rfind("[cluster] ", 0), 0u) << msg;
    EXPECT_NE(msg.find(fragment), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }
}

TEST(Topology, UniformNodesAndBandwidth) {
  Topology t = Topology::uniform(20, 8);
  EXPECT_EQ(t.world_size(), 20);
  EXPECT_EQ(t.num_nodes(), 3);
  EXPECT_EQ(t.node_of(7), 0);
  EXPECT_EQ(t.node_of(8), 1);
  EXPECT_EQ(t.node_of(19), 2);
  EXPECT_DOUBLE_EQ(t.bandwidth(0, 7), 100);
  EXPECT_DOUBLE_EQ(t.bandwidth(0, 8), 25);
  EXPECT_TRUE(std::isinf(t.bandwidth(3, 3)));
  EXPECT_THROW(Topology::uniform(0), Error);
  EXPECT_THROW(Topology::uniform(4, 0), Error);
  EXPECT_THROW(t.rank(20), Error);
}

TEST(Topology, ParsesTheMixedCluster) {
  Topology t = Topology::from_json(mixed_cluster());
  EXPECT_EQ(t.world_size(), 16);
  EXPECT_EQ(t.num_nodes(), 2);
  EXPECT_EQ(t.device_type(3).name, "H800");
  EXPECT_DOUBLE_EQ(t.device_type(3).tflops, 990);
  EXPECT_EQ(t.rank(9).device_type, "H20");
  EXPECT_DOUBLE_EQ(t.rank(9).slowdown, 2.0);
  EXPECT_DOUBLE_EQ(t.rank(9).memory_cap_gib, 4);
  EXPECT_DOUBLE_EQ(t.rank(1).slowdown, 1.0);
  EXPECT_DOUBLE_EQ(t.bandwidth(0, 1), 400);
  EXPECT_DOUBLE_EQ(t.bandwidth(8, 9), 900);
  EXPECT_DOUBLE_EQ(t.bandwidth(0, 9), 25);
}

TEST(Topology, DefaultsAndRoundTrip) {
  json j = json::parse(R"({"catalog": {"A": {"tflops": 10, "memory_gib": 16}},
                           "nodes": [{"type": "A", "ranks": [0, 1]}, {"type": "A", "ranks": [2, 2]}]})");
  Topology t = Topology::from_json(j);
  EXPECT_DOUBLE_EQ(t.bandwidth(0, 1), 100);
  EXPECT_DOUBLE_EQ(t.bandwidth(1, 2), 25);
  Topology back = Topology::from_json(t.to_json());
  EXPECT_EQ(back.to_json(), t.to_json());
  Topology mixed = Topology::from_json(mixed_cluster());
  EXPECT_EQ(Topology::from_json(mixed.to_json()).to_json(), mixed.to_json());
  EXPECT_EQ(Topology::from_json(Topology::uniform(10, 4).to_json()).num_nodes(), 3);
}

TEST(Topology, NodesInAnyOrder) {
  json j = mixed_cluster();
  std::swap(j["nodes"][0], j["nodes"][1]);
  Topology t = Topology::from_json(j);
  EXPECT_EQ(t.node_of(0), 1);
  EXPECT_EQ(t.device_type(0).name, "H800");
}

TEST(Topology, Errors) {
  json j = mixed_cluster();
  j["extra"] = 1;
  expect_error(j, "cluster.extra: unknown field");
  j = mixed_cluster();
  j["catalog"]["H20"]["nvlink"] = 1;
  expect_error(j, "catalog.H20.nvlink: unknown field");
  j = mixed_cluster();
  j["nodes"][1]["type"] = "A100";
  expect_error(j, "unknown device type 'A100'");
  j = mixed_cluster();
  j["nodes"][1]["ranks"] = {7, 15};
  expect_error(j, "rank 7 is already in nodes[0]");
  j = mixed_cluster();
  j["nodes"][1]["ranks"] = {9, 15};
  expect_error(j, "rank 8 is missing");
  j = mixed_cluster();
  j["catalog"]["H800"]["inter_node_gbps"] = 0;
  expect_error(j, "catalog.H800.inter_node_gbps: must be positive");
  j = mixed_cluster();
  j["nodes"][0]["slowdown"] = -1;
  expect_error(j, "nodes[0].slowdown: must be positive");
  j = mixed_cluster();
  j["catalog"]["H800"]["memory_gib"] = 1e308;
  expect_error(j, "catalog.H800.memory_gib: must be at most 1e9, got 1e+308");
  for (double x : {1e30, 1e308, 1e-300, 1e-4, 1001.0}) {
    j = mixed_cluster();
    j["nodes"][0]["slowdown"] = x;
    expect_error(j, "nodes[0].slowdown: must lie in [0.001, 1000] (a compute-time multiplier)");
  }
  j = mixed_cluster();
  j["catalog"]["H800"].erase("tflops");
  expect_error(j, "catalog.H800.tflops: missing");
  j = mixed_cluster();
  j["nodes"][0]["ranks"] = {3};
  expect_error(j, "nodes[0].ranks: must be [first, last]");
  j = mixed_cluster();
  j["nodes"][0]["ranks"] = {5, 2};
  expect_error(j, "is before first rank");
  j = mixed_cluster();
  j["nodes"][0]["type"] = 3;
  expect_error(j, "nodes[0].type: must be a string");
  expect_error(json::array(), "cluster: must be an object");
  j = mixed_cluster();
  j["nodes"][1]["ranks"] = {8, 1000000000};
  expect_error(j, "nodes[1].ranks[1]: rank 1000000000 is above the limit of 1048576 ranks");
  EXPECT_THROW(Topology::uniform(1000000000), Error);
}

TEST(Topology, FileWithDuplicateKeyIsRejected) {
  const std::string path = ::testing::TempDir() + "hspmd_cluster_dup.json";
  std::string text = mixed_cluster().dump();
  text.insert(1, "\"nodes\": [], ");
  { std::ofstream(path) << text; }
  try {
    Topology::load(path);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), "[cluster] " + path + ": duplicate key 'nodes'");
  }
  std::remove(path.c_str());
}

TEST(Topology, LoadNamesTheFile) {
  const std::string path = ::testing::TempDir() + "hspmd_cluster_test.json";
  {
    std::ofstream f(path);
    f << "{\"catalog\": {}, ";
  }
  try {
    Topology::load(path);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
    EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << e.what();
  }
  {
    std::ofstream f(path);
    f << mixed_cluster().dump();
  }
  EXPECT_EQ(Topology::load(path).world_size(), 16);
  std::remove(path.c_str());
  EXPECT_THROW(Topology::load(path), Error);
}

// The cost model's catalog fields (docs/cluster.md): defaults, round trip,
// a relative profile path made relative to the cluster file, errors.
TEST(Topology, CostModelFields) {
  json j = mixed_cluster();
  Topology t = Topology::from_json(j);
  EXPECT_DOUBLE_EQ(t.device_type(0).efficiency, 0.5);
  EXPECT_DOUBLE_EQ(t.device_type(0).hbm_gbps, 2000);
  EXPECT_DOUBLE_EQ(t.device_type(0).latency_us, 0);
  EXPECT_TRUE(t.device_type(0).profile.empty());
  j["catalog"]["H800"]["efficiency"] = 0.4;
  j["catalog"]["H800"]["latency_us"] = 5;
  j["catalog"]["H800"]["profile"] = "h800.json";
  t = Topology::from_json(j);
  EXPECT_DOUBLE_EQ(t.device_type(0).efficiency, 0.4);
  EXPECT_DOUBLE_EQ(t.device_type(0).latency_us, 5);
  EXPECT_EQ(t.device_type(0).profile, "h800.json");
  const Topology back = Topology::from_json(t.to_json());
  EXPECT_DOUBLE_EQ(back.device_type(0).efficiency, 0.4);
  EXPECT_EQ(back.device_type(0).profile, "h800.json");
  EXPECT_TRUE(back.device_type(8).profile.empty());
  const std::string dir = ::testing::TempDir() + "hspmd_topology_profile";
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/c.json") << j.dump();
  EXPECT_EQ(Topology::load(dir + "/c.json").device_type(0).profile, dir + "/h800.json");
  std::filesystem::remove_all(dir);
  json bad = mixed_cluster();
  bad["catalog"]["H20"]["efficiency"] = 1.5;
  expect_error(bad, "catalog.H20.efficiency: must be at most 1");
  bad = mixed_cluster();
  bad["catalog"]["H20"]["efficiency"] = 0;
  expect_error(bad, "catalog.H20.efficiency: must be positive");
  bad = mixed_cluster();
  bad["catalog"]["H20"]["latency_us"] = -1;
  expect_error(bad, "catalog.H20.latency_us: must be non-negative");
  bad = mixed_cluster();
  bad["catalog"]["H20"]["profile"] = 3;
  expect_error(bad, "catalog.H20.profile: must be a file name");
}

}  // namespace
}  // namespace hspmd
