// Measured links (resolve/links.h) and Topology::with_links.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "hspmd/core/error.h"
#include "hspmd/resolve/links.h"
#include "hspmd/resolve/topology.h"

namespace hspmd {
namespace {

using nlohmann::json;

json three_hosts() {
  return json::parse(R"({"hosts": ["h0", "h1", "h2"], "repeats": 3, "links": [
    {"hosts": [0, 1], "gbps": 0.012, "latency_us": 50, "samples": [{"bytes": 8, "seconds": 5e-5}]},
    {"hosts": [2, 0], "gbps": 0.0012, "latency_us": 80},
    {"hosts": [1, 1], "gbps": 1.5, "latency_us": 5}]})");
}

// Three nodes of two ranks, typed 100 GB/s inside and 25 across, latency 1 us.
Topology cluster() {
  return Topology::from_json(json::parse(R"({"catalog": {"cpu": {"tflops": 1, "memory_gib": 1, "latency_us": 1}},
    "nodes": [{"type": "cpu", "ranks": [0, 1]}, {"type": "cpu", "ranks": [2, 3]}, {"type": "cpu", "ranks": [4, 5]}]})"));
}

TEST(Links, RoundTripAndFind) {
  const LinkTable t = LinkTable::from_json(three_hosts());
  ASSERT_EQ(t.links.size(), 3u);
  EXPECT_EQ(t.find(0, 2), t.find(2, 0));
  EXPECT_DOUBLE_EQ(t.find(0, 2)->gbps, 0.0012);
  EXPECT_EQ(t.find(1, 2), nullptr);
  EXPECT_EQ(t.find(0, 1)->samples.size(), 1u);
  const LinkTable back = LinkTable::from_json(t.to_json());
  EXPECT_EQ(back.to_json(), t.to_json());
}

void expect_error(json j, const std::string& text) {
  try {
    LinkTable::from_json(j);
    ADD_FAILURE() << "no error, wanted " << text;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
  }
}

TEST(Links, Errors) {
  json j = three_hosts();
  j["links"][0]["gbps"] = 0;
  expect_error(j, "[links] links[0].gbps: must be positive");
  j = three_hosts();
  j["links"][1]["hosts"] = {0, 3};
  expect_error(j, "links[1].hosts: host 3 is not in hosts");
  j = three_hosts();
  j["links"][2]["hosts"] = {1, 0};
  expect_error(j, "links[2].hosts: hosts 1 and 0 are measured twice");
  j = three_hosts();
  j["links"][0]["speed"] = 1;
  expect_error(j, "links[0].speed: unknown field");
  j = three_hosts();
  j["links"][0]["latency_us"] = -1;
  expect_error(j, "links[0].latency_us: must be >= 0");
  j = three_hosts();
  j.erase("hosts");
  expect_error(j, "hosts: missing");
}

TEST(Links, ReplaceTheTypedLinksOfTheMeasuredPairs) {
  const Topology typed = cluster();
  const Topology t = typed.with_links(LinkTable::from_json(three_hosts()));
  EXPECT_FALSE(typed.has_measured_links());
  EXPECT_TRUE(t.has_measured_links());
  // Across hosts the link is shared by the two ranks of a node.
  EXPECT_DOUBLE_EQ(t.bandwidth(0, 2), 0.006);
  EXPECT_DOUBLE_EQ(t.bandwidth(3, 1), 0.006);
  EXPECT_DOUBLE_EQ(t.bandwidth(5, 0), 0.0006);
  EXPECT_DOUBLE_EQ(t.latency_us(5, 0), 80);
  EXPECT_DOUBLE_EQ(t.bandwidth(2, 3), 1.5);  // inside host 1: not shared
  EXPECT_DOUBLE_EQ(t.latency_us(2, 3), 5);
  // Pairs not measured keep the typed links.
  EXPECT_DOUBLE_EQ(t.bandwidth(2, 4), 25);
  EXPECT_DOUBLE_EQ(t.bandwidth(0, 1), 100);
  EXPECT_DOUBLE_EQ(t.latency_us(0, 1), 1);
  EXPECT_TRUE(std::isinf(t.bandwidth(4, 4)));
  EXPECT_DOUBLE_EQ(t.latency_us(4, 4), 0);
}

TEST(Links, MoreHostsThanNodesIsAnError) {
  json j = three_hosts();
  j["hosts"].push_back("h3");
  try {
    cluster().with_links(LinkTable::from_json(j));
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("[links] the file measures 4 hosts but the cluster has 3 nodes"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace hspmd
