// The merge rules of the kernel core: what happens to an evicted token
// (CamParams.merge holds a rule's code). The same table as python/camkv/merges.py,
// which the hosts pack codes from; tests/test_ext.py checks the two against each
// other through camkv._ext.merge_rules(). Adding a rule: CONTRIBUTING.md.
//
// Written in the core's common subset of C++, Metal and CUDA (see camkv_core.h),
// after the prelude, before the core.

#ifndef CAMKV_MERGES_H
#define CAMKV_MERGES_H

// Where an evicted token goes: nowhere, into its most similar non-sink survivor,
// or spread over the `window` survivors after it (s_e / |W| each).
#define CAMKV_KIND_DROP 0
#define CAMKV_KIND_NEAREST 1
#define CAMKV_KIND_WINDOW 2

// A blending rule's weight w, the target becoming (1 - w) target + w source:
// from the cosine of the evicted key with the target's (nearest rules; 0 in a
// window), the mass the target receives (s_e, or s_e / |W| in a window), the
// target's own score before the merge, and the L2 norms of the evicted value and of
// the target's value before the merge (rules listed in CAMKV_VALUE_NORM_RULES; 0
// for the others).

CAMKV_INLINE float camkv_weight_cosine(float cosine, float s_in, float s_target, float norm_in, float norm_target) {
  return cosine < 0.0f ? 0.0f : (cosine > 1.0f ? 1.0f : cosine);
}

CAMKV_INLINE float camkv_weight_half(float cosine, float s_in, float s_target, float norm_in, float norm_target) {
  return 0.5f;
}

// s_in / (s_in + s_target), 0 if both are 0: blending with it makes the target the
// attention-mass-weighted mean of itself and what it receives (scores are >= 0).
CAMKV_INLINE float camkv_weight_mass(float cosine, float s_in, float s_target, float norm_in, float norm_target) {
  float total = s_in + s_target;
  return total > 0.0f ? s_in / total : 0.0f;
}

// w / (1 + w) with w = clamp(cos, 0, 1) |V_e| / (|V_e| + |V_t|) (0 where both norms
// are 0): one merge of kvpress's MergingPress, V_t <- (V_t + w V_e) / (1 + w), as a blend.
CAMKV_INLINE float camkv_weight_value_norm(float cosine, float s_in, float s_target, float norm_in,
                                           float norm_target) {
  float total = norm_in + norm_target;
  float share = total > 0.0f ? norm_in / total : 0.0f;
  float w = camkv_weight_cosine(cosine, s_in, s_target, norm_in, norm_target) * share;
  return w / (1.0f + w);
}

// The weight of a rule that does not blend (never read).
CAMKV_INLINE float camkv_weight_none(float cosine, float s_in, float s_target, float norm_in, float norm_target) {
  return 0.0f;
}

// One row per rule, in code order: X(name, code, kind, blends, keys_allowed, weight).
// blends 0: a window rule adds V_e / |W| to each target instead (a nearest rule always
// blends); keys_allowed 1: merge_keys blends the key too (nearest rules only).
#define CAMKV_MERGE_RULES(X)                                  \
  X(sim_weighted, 0, NEAREST, 1, 1, camkv_weight_cosine)      \
  X(mean, 1, NEAREST, 1, 1, camkv_weight_half)                \
  X(window, 2, WINDOW, 0, 0, camkv_weight_none)               \
  X(drop, 3, DROP, 0, 0, camkv_weight_none)                   \
  X(mass_weighted, 4, NEAREST, 1, 1, camkv_weight_mass)       \
  X(window_mass, 5, WINDOW, 1, 0, camkv_weight_mass)         \
  X(value_norm, 6, NEAREST, 1, 1, camkv_weight_value_norm)

struct CamMergeRule {
  int kind;          // CAMKV_KIND_*, -1 for an unknown code
  int blends;        // 1: targets blend with the rule's weight; 0: they add their share
  int keys_allowed;  // 1: merge_keys may blend keys
};

#define CAMKV_RULE_CASE(name, code, kind_, blends_, keys_, weight_) \
  case code:                                                         \
    rule.kind = CAMKV_KIND_##kind_;                                  \
    rule.blends = blends_;                                           \
    rule.keys_allowed = keys_;                                       \
    break;

// The properties of rule `merge` (kind -1 if no rule has that code).
CAMKV_INLINE CamMergeRule camkv_merge_rule(int merge) {
  CamMergeRule rule;
  rule.kind = -1;
  rule.blends = 0;
  rule.keys_allowed = 0;
  switch (merge) {
    CAMKV_MERGE_RULES(CAMKV_RULE_CASE)
  }
  return rule;
}
#undef CAMKV_RULE_CASE

#define CAMKV_WEIGHT_CASE(name, code, kind_, blends_, keys_, weight_) \
  case code:                                                           \
    return weight_(cosine, s_in, s_target, norm_in, norm_target);

// Rule `merge`'s blend weight (see the weight functions above).
CAMKV_INLINE float camkv_merge_weight(int merge, float cosine, float s_in, float s_target, float norm_in,
                                      float norm_target) {
  switch (merge) {
    CAMKV_MERGE_RULES(CAMKV_WEIGHT_CASE)
  }
  return 0.0f;
}
#undef CAMKV_WEIGHT_CASE

// The rules whose weight reads the value norms, X(name, code): the core computes
// |V_e| and |V_t| for these only (two dot products a merge), and passes 0 otherwise.
#define CAMKV_VALUE_NORM_RULES(X) X(value_norm, 6)

#define CAMKV_NORM_CASE(name, code) \
  case code:                        \
    return 1;

// 1 if rule `merge`'s weight reads the value norms.
CAMKV_INLINE int camkv_reads_value_norms(int merge) {
  switch (merge) {
    CAMKV_VALUE_NORM_RULES(CAMKV_NORM_CASE)
  }
  return 0;
}
#undef CAMKV_NORM_CASE

#endif  // CAMKV_MERGES_H
