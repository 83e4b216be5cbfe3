// Bit-exact emulation of PyTorch's CPU torch.topk (aten/native/TopKImpl.h, topk_impl_loop),
// including WHICH of several equal values it returns and in what order.
//
// torch ranks (value, index) pairs of a row with libstdc++'s std::partial_sort,
// std::nth_element and std::sort. Those are not stable, so among equal values the winners
// and their order are whatever the algorithms happen to leave in front, and models depend
// on it (bf16 scores tie a lot). The `libstdcxx` namespace below re-implements the
// algorithms step for step (same pivots, same swaps, same heap moves), so they leave
// exactly the same permutation as libstdc++ (checked against GCC 12's std:: algorithms,
// and against torch 2.13, which is built with GCC 13).
//
// Header-only C++17, no STL, usable from CUDA device code (CSA_HD). Non-template helpers
// are static members of structs, so the file does not care whether CSA_HD carries `inline`.
// Ranking uses integer keys and NaN tests on bits, so fast-math, flush-to-zero and
// denormals-are-zero modes cannot change a result.
#pragma once

#include <cstdint>
#include <cstring>

#include "host_device.h"

namespace csa {

// One entry of torch's `queue`. torch stores (float value, index); we store an integer
// key that orders exactly as torch's float comparisons do (see IeeeOrder).
struct TopKPair {
  uint32_t key;
  int64_t index;
};

// Maps IEEE bits to a key whose unsigned order is the float order, with -0 == +0 and every
// NaN equal to every other NaN and above +inf. That is exactly torch's ranking: both of
// its comparators treat NaN as the largest value ("nan sorted as top, numpy compatible").
struct IeeeOrder {
  CSA_HD static uint32_t key(uint32_t bits, uint32_t sign_bit, uint32_t inf_bits) {
    const uint32_t magnitude = bits & (sign_bit - 1u);
    if (magnitude > inf_bits) return 0xFFFFFFFFu;  // NaN
    if (magnitude == 0u) return sign_bit;          // +0 and -0 compare equal
    // Negatives: larger magnitude is smaller, so flip; positives: lift above negatives.
    return (bits & sign_bit) ? (sign_bit - 1u) - magnitude : sign_bit | bits;
  }
};

// Stored element formats: how torch widens a value to rank it and what it writes back.
struct TopKF32 {
  using Storage = float;
  CSA_HD static uint32_t bits(float x) {
    uint32_t b;
    memcpy(&b, &x, sizeof b);
    return b;
  }
  CSA_HD static uint32_t key(float x) { return IeeeOrder::key(bits(x), 0x80000000u, 0x7F800000u); }
  CSA_HD static float output(float x) { return x; }  // copied back unchanged, NaN payload too
};

// bfloat16 as raw bits (Ort::BFloat16_t, c10::BFloat16, __nv_bfloat16 all store this).
struct TopKBF16 {
  using Storage = uint16_t;
  CSA_HD static float bf16_bits_to_float(uint16_t b) {
    const uint32_t u = static_cast<uint32_t>(b) << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
  }
  // torch ranks bf16 rows as float; bf16 -> float only appends zero bits, same key.
  CSA_HD static uint32_t key(uint16_t b) { return TopKF32::key(bf16_bits_to_float(b)); }
  // torch's queue holds floats, narrowed back with c10's round-to-nearest-even: exact
  // for values that came from bf16, except that every NaN becomes the canonical 0x7FC0.
  CSA_HD static uint16_t output(uint16_t b) {
    return (b & 0x7FFFu) > 0x7F80u ? static_cast<uint16_t>(0x7FC0u) : b;
  }
};

// IEEE half as raw bits. torch keeps Half in its queue (no float round trip), so the
// output is the input bits; ranking by a 16-bit key equals ranking the widened floats.
struct TopKF16 {
  using Storage = uint16_t;
  CSA_HD static uint32_t key(uint16_t h) { return IeeeOrder::key(h, 0x8000u, 0x7C00u); }
  CSA_HD static uint16_t output(uint16_t h) { return h; }
};

// torch's two comparators ("x goes before y"), in key form.
struct TopKLargestFirst {
  CSA_HD bool operator()(const TopKPair& x, const TopKPair& y) const { return x.key > y.key; }
};
struct TopKSmallestFirst {
  // NaN keys are the maximum, so NaNs go last here, as (!isnan(x) && isnan(y)) || x < y does.
  CSA_HD bool operator()(const TopKPair& x, const TopKPair& y) const { return x.key < y.key; }
};

// Replicas of libstdc++'s internal algorithms (bits/stl_heap.h, bits/stl_algo.h), named
// after them. Iterators are pointers, distances int64_t; `comp(a, b)` means "a before b"
// (for the heap: a ranks below b, so the heap top is the element that goes last).
namespace libstdcxx {

// std::__lg: floor(log2(n)) for n > 0.
template <typename I>
CSA_HD I lg(I n) {
  I r = 0;
  while (n > 1) {
    n >>= 1;
    ++r;
  }
  return r;
}

template <typename E>
CSA_HD void iter_swap(E* a, E* b) {
  E t = *a;
  *a = *b;
  *b = t;
}

// Sift `value` up from `hole` towards `top`.
template <typename E, typename C>
CSA_HD void push_heap(E* first, int64_t hole, int64_t top, E value, C comp) {
  int64_t parent = (hole - 1) / 2;
  while (hole > top && comp(first[parent], value)) {
    first[hole] = first[parent];
    hole = parent;
    parent = (hole - 1) / 2;
  }
  first[hole] = value;
}

// Floyd's sift-down: walk the hole to a leaf along the larger children without looking
// at `value`, then sift `value` back up. Ties between children go to the right child
// (the left one wins only if the right ranks strictly below it).
template <typename E, typename C>
CSA_HD void adjust_heap(E* first, int64_t hole, int64_t len, E value, C comp) {
  const int64_t top = hole;
  int64_t second_child = hole;
  while (second_child < (len - 1) / 2) {
    second_child = 2 * (second_child + 1);
    if (comp(first[second_child], first[second_child - 1])) --second_child;
    first[hole] = first[second_child];
    hole = second_child;
  }
  // Even length: the last parent has a left child only.
  if ((len & 1) == 0 && second_child == (len - 2) / 2) {
    second_child = 2 * (second_child + 1);
    first[hole] = first[second_child - 1];
    hole = second_child - 1;
  }
  push_heap(first, hole, top, value, comp);
}

// Move the top of heap [first, last) to *result; *result's old value re-enters the heap.
template <typename E, typename C>
CSA_HD void pop_heap(E* first, E* last, E* result, C comp) {
  E value = *result;
  *result = *first;
  adjust_heap(first, int64_t{0}, static_cast<int64_t>(last - first), value, comp);
}

template <typename E, typename C>
CSA_HD void make_heap(E* first, E* last, C comp) {
  const int64_t len = last - first;
  if (len < 2) return;
  for (int64_t parent = (len - 2) / 2;; --parent) {
    adjust_heap(first, parent, len, first[parent], comp);
    if (parent == 0) return;
  }
}

template <typename E, typename C>
CSA_HD void sort_heap(E* first, E* last, C comp) {
  while (last - first > 1) {
    --last;
    pop_heap(first, last, last, comp);
  }
}

// Keep in [first, middle) a heap of the (middle - first) elements that go first.
template <typename E, typename C>
CSA_HD void heap_select(E* first, E* middle, E* last, C comp) {
  make_heap(first, middle, comp);
  for (E* i = middle; i < last; ++i)
    if (comp(*i, *first)) pop_heap(first, middle, i, comp);
}

// std::partial_sort.
template <typename E, typename C>
CSA_HD void partial_sort(E* first, E* middle, E* last, C comp) {
  heap_select(first, middle, last, comp);
  sort_heap(first, middle, comp);
}

// Swap the median of *a, *b, *c into *result.
template <typename E, typename C>
CSA_HD void move_median_to_first(E* result, E* a, E* b, E* c, C comp) {
  if (comp(*a, *b)) {
    if (comp(*b, *c))
      iter_swap(result, b);
    else if (comp(*a, *c))
      iter_swap(result, c);
    else
      iter_swap(result, a);
  } else if (comp(*a, *c)) {
    iter_swap(result, a);
  } else if (comp(*b, *c)) {
    iter_swap(result, c);
  } else {
    iter_swap(result, b);
  }
}

// Hoare partition around *pivot with no bounds checks: the median-of-three guarantees an
// element on each side that stops the scans. Elements equal to the pivot are swapped too.
template <typename E, typename C>
CSA_HD E* unguarded_partition(E* first, E* last, E* pivot, C comp) {
  while (true) {
    while (comp(*first, *pivot)) ++first;
    --last;
    while (comp(*pivot, *last)) --last;
    if (!(first < last)) return first;
    iter_swap(first, last);
    ++first;
  }
}

template <typename E, typename C>
CSA_HD E* unguarded_partition_pivot(E* first, E* last, C comp) {
  E* mid = first + (last - first) / 2;
  move_median_to_first(first, first + 1, mid, last - 1, comp);
  return unguarded_partition(first + 1, last, first, comp);
}

// Shift *last left past every element it goes before; relies on a stopper to the left.
template <typename E, typename C>
CSA_HD void unguarded_linear_insert(E* last, C comp) {
  E value = *last;
  E* next = last - 1;
  while (comp(value, *next)) {
    *last = *next;
    last = next;
    --next;
  }
  *last = value;
}

template <typename E, typename C>
CSA_HD void insertion_sort(E* first, E* last, C comp) {
  if (first == last) return;
  for (E* i = first + 1; i != last; ++i) {
    if (comp(*i, *first)) {
      // New front element: shift [first, i) up by one (std::move_backward).
      E value = *i;
      for (E* p = i; p != first; --p) *p = *(p - 1);
      *first = value;
    } else {
      unguarded_linear_insert(i, comp);
    }
  }
}

template <typename E, typename C>
CSA_HD void unguarded_insertion_sort(E* first, E* last, C comp) {
  for (E* i = first; i != last; ++i) unguarded_linear_insert(i, comp);
}

constexpr int64_t kSortThreshold = 16;  // libstdc++'s _S_threshold

template <typename E, typename C>
CSA_HD void final_insertion_sort(E* first, E* last, C comp) {
  if (last - first > kSortThreshold) {
    insertion_sort(first, first + kSortThreshold, comp);
    unguarded_insertion_sort(first + kSortThreshold, last, comp);
  } else {
    insertion_sort(first, last, comp);
  }
}

// Quicksort down to runs of <= 16, heapsort when the depth budget runs out. Recursion
// depth is bounded by depth_limit = 2*lg(n).
template <typename E, typename C>
CSA_HD void introsort_loop(E* first, E* last, int64_t depth_limit, C comp) {
  while (last - first > kSortThreshold) {
    if (depth_limit == 0) {
      partial_sort(first, last, last, comp);
      return;
    }
    --depth_limit;
    E* cut = unguarded_partition_pivot(first, last, comp);
    introsort_loop(cut, last, depth_limit, comp);
    last = cut;
  }
}

// std::sort.
template <typename E, typename C>
CSA_HD void sort(E* first, E* last, C comp) {
  if (first == last) return;
  introsort_loop(first, last, 2 * lg(static_cast<int64_t>(last - first)), comp);
  final_insertion_sort(first, last, comp);
}

template <typename E, typename C>
CSA_HD void introselect(E* first, E* nth, E* last, int64_t depth_limit, C comp) {
  while (last - first > 3) {
    if (depth_limit == 0) {
      heap_select(first, nth + 1, last, comp);
      iter_swap(first, nth);  // the heap top is the nth element
      return;
    }
    --depth_limit;
    E* cut = unguarded_partition_pivot(first, last, comp);
    if (cut <= nth)
      first = cut;
    else
      last = cut;
  }
  insertion_sort(first, last, comp);
}

// std::nth_element.
template <typename E, typename C>
CSA_HD void nth_element(E* first, E* nth, E* last, C comp) {
  if (first == last || nth == last) return;
  introselect(first, nth, last, 2 * lg(static_cast<int64_t>(last - first)), comp);
}

}  // namespace libstdcxx

// torch's partial_sort branch (k * 64 <= n) with a queue of k: std::partial_sort is
// heap_select then sort_heap, and heap_select only moves a pair past k into the heap, when it
// goes before the top (pop_heap: the top lands where that pair was, a place nothing reads
// again). So the pairs past k are made one at a time, tested against the top and dropped:
// the same heap moves as on the full queue, without writing n pairs. The row may come in
// pieces, in order (`push`): IndexerTopK feeds it scores as it computes them, so that a
// row's scores never exist all at once.
template <typename Fmt, typename C>
struct HeapSelect {
  TopKPair* heap;  // k entries
  int64_t k;
  int64_t seen = 0;  // values pushed so far: the next one's index in the row

  CSA_HD void push(const typename Fmt::Storage* values, int64_t n) {
    const C comp{};
    for (int64_t j = 0; j < n; ++j, ++seen) {
      const TopKPair pair{Fmt::key(values[j]), seen};
      if (seen < k) {
        heap[seen] = pair;
        if (seen == k - 1) libstdcxx::make_heap(heap, heap + k, comp);
      } else if (comp(pair, heap[0])) {
        libstdcxx::adjust_heap(heap, int64_t{0}, k, pair, comp);
      }
    }
  }
  // Once the heap is full, a value that does not go before heap[0] is dropped untouched:
  // a caller that found the next n values all do not may skip them (IndexerTopK's vector
  // scan).
  CSA_HD bool full() const { return seen >= k; }
  CSA_HD void skip(int64_t n) { seen += n; }
  // After the whole row (at least k values): heap[0..k) is torch's output, in order.
  CSA_HD void finish() { libstdcxx::sort_heap(heap, heap + k, C{}); }
};

template <typename Fmt, typename C>
CSA_HD void partial_sort_streamed(const typename Fmt::Storage* row, int64_t n, int64_t k,
                                  TopKPair* heap, C) {
  HeapSelect<Fmt, C> select{heap, k};
  select.push(row, n);
  select.finish();
}

// torch's selection of row[0..n), 1 <= k <= n: afterwards q[0..k) is its output, in order
// (q: n entries, of which the partial_sort branch uses k).
template <typename Fmt, typename C>
CSA_HD void torch_topk_select(const typename Fmt::Storage* row, int64_t n, int64_t k,
                              bool sorted, TopKPair* q, C comp) {
  if (k * 64 <= n) {
    partial_sort_streamed<Fmt>(row, n, k, q, comp);  // sorted output even if !sorted
    return;
  }
  for (int64_t j = 0; j < n; ++j) q[j] = TopKPair{Fmt::key(row[j]), j};
  libstdcxx::nth_element(q, q + k - 1, q + n, comp);
  // torch sorts only the first k-1: the k-th is already in place after nth_element.
  if (sorted) libstdcxx::sort(q, q + k - 1, comp);
}

// torch.topk of one row of n values along its only axis; 0 <= k <= n (not checked).
// scratch: n entries (k where k * 64 <= n). Writes k values and k int64 indices, as torch's
// CPU kernel does. Fmt: TopKF32 (row is float*), TopKBF16 or TopKF16 (row is raw uint16_t bits).
template <typename Fmt>
CSA_HD void torch_topk_row(const typename Fmt::Storage* row, int64_t n, int64_t k, bool largest,
                           bool sorted, TopKPair* scratch, typename Fmt::Storage* out_values,
                           int64_t* out_indices) {
  if (k <= 0) return;
  if (largest)
    torch_topk_select<Fmt>(row, n, k, sorted, scratch, TopKLargestFirst{});
  else
    torch_topk_select<Fmt>(row, n, k, sorted, scratch, TopKSmallestFirst{});
  for (int64_t j = 0; j < k; ++j) {
    out_indices[j] = scratch[j].index;
    out_values[j] = Fmt::output(row[scratch[j].index]);
  }
}

// Rows [row_begin, row_end) of a contiguous [rows, n] input into [rows, k] outputs,
// reusing one scratch of n entries. The onnxruntime kernel and the test shim both call this.
template <typename Fmt>
CSA_HD void torch_topk_rows(const typename Fmt::Storage* x, int64_t row_begin, int64_t row_end,
                            int64_t n, int64_t k, bool largest, bool sorted, TopKPair* scratch,
                            typename Fmt::Storage* values, int64_t* indices) {
  for (int64_t r = row_begin; r < row_end; ++r)
    torch_topk_row<Fmt>(x + r * n, n, k, largest, sorted, scratch, values + r * k,
                        indices + r * k);
}

}  // namespace csa
