// The merge rules of the kernel core: what happens to an evicted token
// (CamParams.merge holds a rule's code). The same table as python/camkv/merges.py,
// which the hosts pack codes from: tests/test_merges.py checks the two tables against
// each other through camkv._ext.merge_rules(), tests/test_ext.py their shares through
// camkv._ext.merge_shares(). Adding a rule: CONTRIBUTING.md.
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

// A blending rule's shares (docs/algorithm.md section 4.4): the target keeps A_t and
// each evicted token e merging into it enters with a_e, all at once,
//   V_t <- (A_t V_t + sum_e a_e V_e) / (A_t + sum_e a_e)   (unchanged if the sum is not > 0),
// computed as keep V_t + sum_e w_e V_e with w_e = a_e / (A_t + sum a), keep = 1 - sum w
// (one token: (1 - w) V_t + w V_e with w = a / (A_t + a)).
// A target share reads the target's score; a loser share reads the cosine of the
// evicted key with the target's (nearest rules; 0 in a window), the mass it brings (s_e,
// or s_e / |W| in a window), the target's score, and the L2 norms of the evicted value
// and of the target's value (rules listed in CAMKV_VALUE_NORM_RULES; 0 for the others),
// all as they stand before the compression's merges.

CAMKV_INLINE float camkv_share_one(float s_target) {
  return 1.0f;
}

CAMKV_INLINE float camkv_share_score(float s_target) {
  return s_target;
}

CAMKV_INLINE float camkv_clamp01(float x) {
  return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x);
}

CAMKV_INLINE float camkv_loser_one(float cosine, float s_in, float s_target, float norm_in, float norm_target) {
  return 1.0f;
}

// c / (1 - c), c = clamp(cos, 0, 1 - 2^-12): with the target's 1, one token blends as
// (1 - c) V_t + c V_e; the bound keeps the odds finite for a duplicate key.
CAMKV_INLINE float camkv_loser_odds(float cosine, float s_in, float s_target, float norm_in, float norm_target) {
  float c = cosine < 0.0f ? 0.0f : (cosine > 0.999755859375f ? 0.999755859375f : cosine);
  return c / (1.0f - c);
}

// s_in: with the target's own score, the attention-mass-weighted mean (scores are >= 0).
CAMKV_INLINE float camkv_loser_mass(float cosine, float s_in, float s_target, float norm_in, float norm_target) {
  return s_in;
}

// clamp(cos, 0, 1) |V_e| / (|V_e| + |V_t|) (0 where both norms are 0): kvpress's
// MergingPress, V_t <- (V_t + sum u_e V_e) / (1 + sum u_e).
CAMKV_INLINE float camkv_loser_value_norm(float cosine, float s_in, float s_target, float norm_in,
                                          float norm_target) {
  float total = norm_in + norm_target;
  float share = total > 0.0f ? norm_in / total : 0.0f;
  return camkv_clamp01(cosine) * share;
}

// clamp(cos, 0, 1): D2O's similarity-weighted mean, V_t <- (V_t + sum c_e V_e) / (1 + sum c_e).
CAMKV_INLINE float camkv_loser_cosine(float cosine, float s_in, float s_target, float norm_in, float norm_target) {
  return camkv_clamp01(cosine);
}

// The shares of a rule that does not blend (never read).
CAMKV_INLINE float camkv_share_none(float s_target) {
  return 0.0f;
}

CAMKV_INLINE float camkv_loser_none(float cosine, float s_in, float s_target, float norm_in, float norm_target) {
  return 0.0f;
}

// One row per rule, in code order: X(name, code, kind, blends, keys_allowed, target_share,
// loser_share). blends 0: a window rule adds V_e / |W| to each target instead (a nearest
// rule always blends); keys_allowed 1: merge_keys blends the key too (nearest rules only).
// keepkv's shares are the query's masses of section 4.6 (m_t as the target's "score",
// m_e as the mass it brings), which the core computes for it (camkv_keeps_votes).
#define CAMKV_MERGE_RULES(X)                                                   \
  X(sim_weighted, 0, NEAREST, 1, 1, camkv_share_one, camkv_loser_odds)         \
  X(mean, 1, NEAREST, 1, 1, camkv_share_one, camkv_loser_one)                  \
  X(window, 2, WINDOW, 0, 0, camkv_share_none, camkv_loser_none)               \
  X(drop, 3, DROP, 0, 0, camkv_share_none, camkv_loser_none)                   \
  X(mass_weighted, 4, NEAREST, 1, 1, camkv_share_score, camkv_loser_mass)      \
  X(window_mass, 5, WINDOW, 1, 0, camkv_share_score, camkv_loser_mass)         \
  X(value_norm, 6, NEAREST, 1, 1, camkv_share_one, camkv_loser_value_norm)      \
  X(d2o, 7, NEAREST, 1, 1, camkv_share_one, camkv_loser_cosine)                \
  X(keepkv, 8, NEAREST, 1, 0, camkv_share_score, camkv_loser_mass)

struct CamMergeRule {
  int kind;          // CAMKV_KIND_*, -1 for an unknown code
  int blends;        // 1: targets blend with the rule's weight; 0: they add their share
  int keys_allowed;  // 1: merge_keys may blend keys
};

#define CAMKV_RULE_CASE(name, code, kind_, blends_, keys_, target_, loser_) \
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

#define CAMKV_TARGET_SHARE_CASE(name, code, kind_, blends_, keys_, target_, loser_) \
  case code:                                                                   \
    return target_(s_target);

// Rule `merge`'s share A_t of a target whose score is s_target.
CAMKV_INLINE float camkv_target_share(int merge, float s_target) {
  switch (merge) {
    CAMKV_MERGE_RULES(CAMKV_TARGET_SHARE_CASE)
  }
  return 0.0f;
}
#undef CAMKV_TARGET_SHARE_CASE

#define CAMKV_LOSER_SHARE_CASE(name, code, kind_, blends_, keys_, target_, loser_) \
  case code:                                                                  \
    return loser_(cosine, s_in, s_target, norm_in, norm_target);

// Rule `merge`'s share a_e of an evicted token (see the share functions above).
CAMKV_INLINE float camkv_loser_share(int merge, float cosine, float s_in, float s_target, float norm_in,
                                     float norm_target) {
  switch (merge) {
    CAMKV_MERGE_RULES(CAMKV_LOSER_SHARE_CASE)
  }
  return 0.0f;
}
#undef CAMKV_LOSER_SHARE_CASE

// One token's blend weight w = a / (A + a), 0 if A + a is not > 0 (then the target
// keeps its value): the rule's shares for a target that receives one token.
CAMKV_INLINE float camkv_merge_weight(int merge, float cosine, float s_in, float s_target, float norm_in,
                                      float norm_target) {
  float a = camkv_loser_share(merge, cosine, s_in, s_target, norm_in, norm_target);
  float total = camkv_target_share(merge, s_target) + a;
  return total > 0.0f ? a / total : 0.0f;
}

// The rules whose loser share reads the value norms, X(name, code): the core computes
// |V_e| and |V_t| for these only (two dot products a merging token), and passes 0 otherwise.
#define CAMKV_VALUE_NORM_RULES(X) X(value_norm, 6)

// One case of a rule list's membership switch (the three lists' tests below).
#define CAMKV_LISTED_CASE(name, code) \
  case code:                          \
    return 1;

// 1 if rule `merge`'s loser share reads the value norms.
CAMKV_INLINE int camkv_reads_value_norms(int merge) {
  switch (merge) {
    CAMKV_VALUE_NORM_RULES(CAMKV_LISTED_CASE)
  }
  return 0;
}

// The rules that carry per-row state between calls (docs/algorithm.md sections 1, 4.5
// and 4.6), X(name, code): each stored row's votes (they weigh its attention, and keepkv
// merges keep the current query's attention output), and each row's moving similarity
// threshold (d2o merges only above it). The hosts pass these arrays in and take them out.
#define CAMKV_VOTE_RULES(X) X(keepkv, 8)
#define CAMKV_THRESHOLD_RULES(X) X(d2o, 7)

// 1 if rule `merge` keeps votes per stored row.
CAMKV_INLINE int camkv_keeps_votes(int merge) {
  switch (merge) {
    CAMKV_VOTE_RULES(CAMKV_LISTED_CASE)
  }
  return 0;
}

// 1 if rule `merge` merges only above its row's moving threshold.
CAMKV_INLINE int camkv_moves_threshold(int merge) {
  switch (merge) {
    CAMKV_THRESHOLD_RULES(CAMKV_LISTED_CASE)
  }
  return 0;
}
#undef CAMKV_LISTED_CASE

// D2O's threshold after a compression whose losers' nearest cosines have the finite sum
// `sum` over `count` of them (section 4.5): their mean at a row's first compression (tau
// NaN), else D2O_KEEP tau + (1 - D2O_KEEP) mean (camkv.merges.moved_threshold), with
// D2O_KEEP = 0.5; unchanged when count is 0.
CAMKV_INLINE float camkv_moved_threshold(float tau, float sum, int count) {
  if (count == 0) {
    return tau;
  }
  float mean = sum / (float)count;
  return tau != tau ? mean : 0.5f * tau + 0.5f * mean;
}

#endif  // CAMKV_MERGES_H
