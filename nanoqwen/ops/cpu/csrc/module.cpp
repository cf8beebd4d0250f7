// The extension's Python module: the kernels of the files beside this one (cpu_kernels.h lists them), and a
// decode step's whole forward in one call (nanoqwen/worker/fused_decoder.py drives it).

#include <torch/extension.h>

#include <cmath>

#include "cpu_kernels.h"

namespace nanoqwen {

// One matrix as decode_model takes it: its format's name and its tensors (linear_part below).
using LinearPart = std::pair<std::string, std::vector<at::Tensor>>;
// A linear as decode_model takes it: its parts, each a matrix in one format, their outputs side by side (a fused
// q/k/v whose parts a checkpoint holds in different formats); most have one part.
using LinearParts = std::vector<LinearPart>;

// A decoder layer's weights as decode_model takes them, gathered once (worker/fused_decoder.py makes one a layer).
struct DecoderLayerWeights {
  at::Tensor input_norm, post_norm;
  double eps;
  LinearParts qkv_proj;
  at::Tensor q_norm, k_norm;
  LinearParts o_proj, gate_up_proj, down_proj;
  int64_t num_heads;
};

// The whole model as decode_model takes it: the embedding table, RotaryEmbedding's cos and sin tables (float32,
// [max_len, D]), the decoder layers, the final norm and the LM head (a linear's tensors, as above).
struct DecoderModelWeights {
  LinearPart embed;  // the table as a linear's matrix (embed_rows below)
  at::Tensor cos, sin;
  std::vector<DecoderLayerWeights> layers;
  at::Tensor norm;
  double eps;
  LinearParts lm_head;
};

// A LoRA adapter on one linear as decode_model adds it: none (no tensors), or (a [R, in], b [out, R]) bf16 with the
// adapter's scaling in b, adding (x @ a.T) @ b.T to the linear's output (all of its parts: b's rows are its output
// columns, zero where a part has no adapter). The same matrices and products as nanoqwen/lora/layers.py's LoRALayer
// for a step whose rows all use one slot.
using LinearLoRA = std::vector<at::Tensor>;

// A decoder layer's adapters, one for each of its linears (any of them none).
struct DecoderLayerLoRA {
  LinearLoRA qkv_proj, o_proj, gate_up_proj, down_proj;
};

// One adapter over the whole model, as decode_model and decode_steps take it: a DecoderLayerLoRA a layer (the LoRA
// manager makes one a slot, nanoqwen/lora/manager.py).
struct DecoderLoRAWeights {
  std::vector<DecoderLayerLoRA> layers;
};

namespace {

// A tensor given as "none" (an empty one, where a format's list has a fixed length): nullopt.
std::optional<at::Tensor> given(const at::Tensor& t) {
  return t.numel() > 0 ? std::optional<at::Tensor>(t) : std::nullopt;
}

// A linear part's matrix by its format (worker/fused_decoder.py linear_tensors): "bf16" (weight); "int8" (q, scale):
// a bf16 scale per row; "int8_group" (q, scale, offset, super_scale, super_offset), the last three possibly none:
// int8_group_gemv's; "int4" (packed, scale, offset: none where symmetric) or two-level (packed, scale, offset,
// super_scale, super_offset); "fp8" (w float8_e4m3fn, scale float32 per row and block of inputs).
at::Tensor linear_part(const at::Tensor& x, const LinearPart& part) {
  const auto& [format, t] = part;
  if (format == "bf16" && t.size() == 1) return bf16_gemv(x, t[0], std::nullopt);
  if (format == "int8" && t.size() == 2) return int8_gemv(x, t[0], t[1]);
  if (format == "fp8" && t.size() == 2) return fp8_gemv(x, t[0], t[1]);
  if (format == "int8_group" && t.size() == 5)
    return int8_group_gemv(x, t[0], t[1], given(t[2]), given(t[3]), given(t[4]));
  if (format == "int4" && t.size() == 3)
    return int4_gemv(x, t[0], t[1], given(t[2]), std::nullopt, std::nullopt, int4_amx_min_rows());
  if (format == "int4" && t.size() == 5) return int4_gemv(x, t[0], t[1], t[2], t[3], t[4], int4_amx_min_rows());
  TORCH_CHECK(false, "a linear in format '", format, "' with ", t.size(), " tensors is none decode_model takes");
}

// x through a linear's parts, their outputs side by side.
at::Tensor linear(const at::Tensor& x, const LinearParts& parts) {
  TORCH_CHECK(!parts.empty(), "a linear without parts");
  if (parts.size() == 1) return linear_part(x, parts[0]);
  std::vector<at::Tensor> outputs;
  for (const auto& part : parts) outputs.push_back(linear_part(x, part));
  return at::cat(outputs, -1);
}

// x through a linear's parts plus its adapter's product, if it has one: the base output, then y + (x @ a.T) @ b.T
// through bf16_gemv twice, as the LoRA hook computes it on this path (the same kernels in the same order, so the same
// bits).
at::Tensor linear_with_lora(const at::Tensor& x, const LinearParts& parts, const LinearLoRA& lora) {
  at::Tensor y = linear(x, parts);
  if (lora.empty()) return y;
  return y + bf16_gemv(bf16_gemv(x, lora[0], std::nullopt), lora[1], std::nullopt);
}

// The embedding rows of ids [M] as bf16 [M, H], from a table held as a linear's matrix (above): a bf16 table's rows,
// or a quantised table's rows dequantised in float32 and rounded to bf16 once, with the operations (a product,
// then a sum) of quantization/prequantized.py's QuantizedEmbedding, so the same bits.
at::Tensor embed_rows(const LinearPart& table, const at::Tensor& ids) {
  const auto& [format, t] = table;
  if (format == "bf16") return t[0].index_select(0, ids);
  TORCH_CHECK(format == "int8_group" || format == "int4", "an embedding table in format '", format,
              "' is none decode_model takes");
  const int64_t M = ids.numel(), groups = t[1].size(1);
  // a group's scale (and offset) as float32 [rows, groups]: one level, or sub-scales times their super-block's
  auto two_level = [](const at::Tensor& sub, const at::Tensor& super) {
    return super.repeat_interleave(sub.size(1) / super.size(1), 1) * sub.to(at::kFloat);
  };
  if (format == "int8_group") {  // the ids' rows through the prompt path's dequantise (the same bits as the reference)
    auto rows = [&](const at::Tensor& t) { return given(t) ? std::optional<at::Tensor>(t.index_select(0, ids))
                                                            : std::nullopt; };
    const at::Tensor q = t[0].index_select(0, ids);
    return int8_group_dequantize(q, t[1].index_select(0, ids), rows(t[2]), rows(t[3]), rows(t[4]),
                                 q.size(1) * 8 / int8_group_bits(q, groups))
        .to(at::kBFloat16);
  }
  // int4, rows stored lane by lane in blocks of 16 (quantization/int4.py): each id's block, then its lane
  constexpr int64_t kLanes = 16;
  const int64_t N = t[0].size(0);
  TORCH_CHECK(N % kLanes == 0, "an int4 embedding table needs whole blocks of 16 rows, got ", N);
  const at::Tensor block = at::floor_divide(ids, kLanes), lane = at::remainder(ids, kLanes);
  auto pick = [&](const at::Tensor& x, int64_t width) {  // [N, c * width] lanes -> the ids' rows [M, c, width]
    at::Tensor blocks = x.view({N / kLanes, -1, kLanes, width}).index_select(0, block);  // [M, c, 16, width]
    at::Tensor at_lane = lane.view({M, 1, 1, 1}).expand({M, blocks.size(1), 1, width});
    return blocks.gather(2, at_lane).squeeze(2);
  };
  const at::Tensor bytes = pick(t[0], 4).reshape({M, groups, -1});  // [M, groups, G/2]
  const at::Tensor q = at::cat({at::bitwise_and(bytes, 15), at::bitwise_right_shift(bytes, 4)}, -1).to(at::kFloat);
  at::Tensor scale = pick(t[1], 1).squeeze(-1);  // [M, groups]
  // (symmetric, no offset: -kSymmetricZero times the scale, in float32 as dequantize_int4 makes it)
  at::Tensor offset = given(t[2]) ? pick(t[2], 1).squeeze(-1) : scale.to(at::kFloat) * -kSymmetricZero;
  if (t.size() == 5) {
    scale = two_level(scale, pick(t[3], 1).squeeze(-1));
    offset = two_level(offset, pick(t[4], 1).squeeze(-1));
  }
  return (offset.to(at::kFloat).unsqueeze(-1) + scale.to(at::kFloat).unsqueeze(-1) * q).view({M, -1})
      .to(at::kBFloat16);
}

// One layer of a decode step, as DecoderLayer.forward computes it on this path (the same kernels in the same order,
// so the same bits) without a return to Python: x + attention(norm(x)), then h + mlp(norm(h)). Takes the layer's
// input x and input_norm(x) (x_normed) and returns the layer's output and next_norm of it (the next layer's input
// norm, or the model's final norm): each residual add and the norm after it are one call (add_rms_norm).
std::tuple<at::Tensor, at::Tensor> decode_layer(const at::Tensor& x, const at::Tensor& x_normed,
                                                const DecoderLayerWeights& w, const at::Tensor& next_norm,
                                                double next_eps, const at::Tensor& cos, const at::Tensor& sin,
                                                const at::Tensor& k_cache, const at::Tensor& v_cache,
                                                const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                                                const at::Tensor& context_lens, const DecoderLayerLoRA& lora,
                                                const std::optional<at::Tensor>& k_scale,
                                                const std::optional<at::Tensor>& v_scale) {
  const int64_t M = x.size(0), D = k_cache.size(3), q_size = w.num_heads * D;
  at::Tensor qkv = linear_with_lora(x_normed, w.qkv_proj, lora.qkv_proj);  // [M, (Hq + 2 Hkv) D]
  at::Tensor q = attention_inputs(qkv, w.q_norm, w.k_norm, w.eps, w.num_heads, cos, sin, k_cache, v_cache, slot_mapping,
                                  k_scale, v_scale);
  at::Tensor attn = paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, 1.0 / std::sqrt(double(D)),
                                           k_scale, v_scale);
  const auto [h, h_normed] = add_rms_norm(x, linear_with_lora(attn.view({M, q_size}), w.o_proj, lora.o_proj),
                                          w.post_norm, w.eps);
  const at::Tensor gate_up = linear_with_lora(h_normed, w.gate_up_proj, lora.gate_up_proj);
  return add_rms_norm(h, linear_with_lora(swiglu(gate_up), w.down_proj, lora.down_proj), next_norm, next_eps);
}

// A decode step's forward to the LM head's bf16 output [M, V] (decode_model below says what it takes).
at::Tensor decode_logits(const DecoderModelWeights& model, const at::Tensor& input_ids, const at::Tensor& positions,
                         const at::Tensor& k_caches, const at::Tensor& v_caches, const at::Tensor& slot_mapping,
                         const at::Tensor& block_tables, const at::Tensor& context_lens, const DecoderLoRAWeights* lora,
                         const std::optional<at::Tensor>& k_scales, const std::optional<at::Tensor>& v_scales) {
  const auto& layers = model.layers;
  static const DecoderLayerLoRA no_lora;
  TORCH_CHECK(lora == nullptr || lora->layers.size() == layers.size(), "the adapter has ",
              lora == nullptr ? 0 : lora->layers.size(), " layers, the model ", layers.size());
  TORCH_CHECK(k_caches.dim() == 5 && k_caches.size(0) == int64_t(layers.size()) && v_caches.sizes() == k_caches.sizes(),
              "k_caches and v_caches must be [", layers.size(), ", blocks, block_size, Hkv, D], got ", k_caches.sizes(),
              " and ", v_caches.sizes());
  TORCH_CHECK(!layers.empty(), "a model without decoder layers");
  for (const auto* scales : {&k_scales, &v_scales})
    TORCH_CHECK(!scales->has_value() || ((*scales)->dim() == 4 && (*scales)->size(0) == k_caches.size(0)),
                "k_scales and v_scales must be [", layers.size(), ", blocks, block_size, Hkv], got ",
                (*scales)->sizes());
  auto layer_of = [](const std::optional<at::Tensor>& t, int64_t i) {  // layer i's scales, if the cache has them
    return t.has_value() ? std::optional<at::Tensor>((*t)[i]) : std::nullopt;
  };
  const RecycledOutputs recycled(input_ids.numel());  // the kernels' outputs: the last step's (cpu_kernels.h)
  at::Tensor x = embed_rows(model.embed, input_ids);  // [M, H]
  at::Tensor x_normed = rms_norm(x, layers[0].input_norm, layers[0].eps);
  const at::Tensor cos = model.cos.index_select(0, positions).to(at::kBFloat16);  // [M, D]
  const at::Tensor sin = model.sin.index_select(0, positions).to(at::kBFloat16);
  for (size_t i = 0; i < layers.size(); ++i) {
    const bool last = i + 1 == layers.size();
    std::tie(x, x_normed) = decode_layer(x, x_normed, layers[i], last ? model.norm : layers[i + 1].input_norm,
                                         last ? model.eps : layers[i + 1].eps, cos, sin, k_caches[i], v_caches[i],
                                         slot_mapping, block_tables, context_lens,
                                         lora == nullptr ? no_lora : lora->layers[i], layer_of(k_scales, i),
                                         layer_of(v_scales, i));
  }
  return linear(x_normed, model.lm_head);  // [M, V]: the final norm's output through the LM head
}

}  // namespace

// A decode step's forward, one call a step: input_ids [M] (one token per row) at positions [M] -> float32 logits
// [M, V], as Qwen3ForCausalLM's forward and compute_logits give them on this path (the embedding's rows, cos and
// sin cast to bf16 as RotaryEmbedding casts them, the layers, the final norm, the LM head). Layer i uses the
// caches k_caches[i], v_caches[i] ([layers, blocks, block_size, Hkv, D]); the rest is shared by all layers. lora: one
// adapter for every row (DecoderLoRAWeights), or none (nullptr: the base model). A quantized cache (int8 or float8
// codes: nanoqwen/attention/kv_cache.py) comes with its scales k_scales, v_scales [layers, blocks, block_size, Hkv]
// (none for bf16), layer i's read and written by attention_inputs and paged_decode_attention in place.
at::Tensor decode_model(const DecoderModelWeights& model, const at::Tensor& input_ids, const at::Tensor& positions,
                        const at::Tensor& k_caches, const at::Tensor& v_caches, const at::Tensor& slot_mapping,
                        const at::Tensor& block_tables, const at::Tensor& context_lens, const DecoderLoRAWeights* lora,
                        const std::optional<at::Tensor>& k_scales, const std::optional<at::Tensor>& v_scales) {
  return decode_logits(model, input_ids, positions, k_caches, v_caches, slot_mapping, block_tables, context_lens, lora,
                       k_scales, v_scales)
      .to(at::kFloat);
}

// Greedy decode steps, several in one call (ModelRunner's greedy multi-step decode: num_scheduler_steps): step s
// feeds each row's token from step s - 1 (input_ids [M] at step 0) at position context_lens[m] - 1 + s, stores its
// keys and values there and takes the argmax of its logits as the row's next token: what decode_model and the
// sampler's greedy choice give step after step, without a return to Python. block_tables [M, W] int32 must cover
// every step's position; context_lens [M] int32 are step 0's (each step adds one; a decode row's position is its
// context length - 1). Stops after the step where every row has produced one of its stop_token_ids [M, S] (-1 pads
// a row's list): their sequences are finished. A row whose logits leave nothing to pick (the argmax's logit is
// NaN or infinite: the sampler's BROKEN_ROW) gets -1 as its token, which ends it too; it is fed token 0 after
// that, and what it then makes is dropped. lora, k_scales, v_scales: as decode_model's. Returns the tokens [steps
// run, M] int64.
at::Tensor decode_steps(const DecoderModelWeights& model, const at::Tensor& input_ids, const at::Tensor& k_caches,
                        const at::Tensor& v_caches, const at::Tensor& block_tables_in,
                        const at::Tensor& context_lens_in, const at::Tensor& stop_token_ids_in, int64_t num_steps,
                        const DecoderLoRAWeights* lora, const std::optional<at::Tensor>& k_scales,
                        const std::optional<at::Tensor>& v_scales) {
  const int64_t M = input_ids.numel(), block_size = k_caches.size(2);
  const at::Tensor block_tables = block_tables_in.contiguous(), stops = stop_token_ids_in.contiguous();
  TORCH_CHECK(num_steps >= 1, "num_steps must be >= 1, got ", num_steps);
  TORCH_CHECK(input_ids.dim() == 1 && input_ids.scalar_type() == at::kLong, "input_ids must be int64 [M]");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == M && block_tables.scalar_type() == at::kInt,
              "block_tables must be int32 [", M, ", W]");
  TORCH_CHECK(context_lens_in.sizes() == input_ids.sizes() && context_lens_in.scalar_type() == at::kInt,
              "context_lens must be int32 [", M, "]");
  TORCH_CHECK(stops.dim() == 2 && stops.size(0) == M && stops.scalar_type() == at::kLong,
              "stop_token_ids must be int64 [", M, ", S]");
  at::Tensor context_lens = context_lens_in.clone();
  at::Tensor positions = context_lens.to(at::kLong) - 1, slot_mapping = at::empty({M}, positions.options());
  int64_t* pos = positions.data_ptr<int64_t>();
  int32_t* lens = context_lens.data_ptr<int32_t>();
  int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t* stop = stops.data_ptr<int64_t>();
  const int64_t W = block_tables.size(1), S = stops.size(1);
  for (int64_t m = 0; m < M; ++m)  // (checked before any step writes the cache)
    TORCH_CHECK((pos[m] + num_steps - 1) / block_size < W, "block_tables cover ", W, " blocks, too few for position ",
                pos[m] + num_steps - 1, " of row ", m);
  std::vector<bool> stopped(M, false);
  std::vector<at::Tensor> tokens;
  at::Tensor ids = input_ids;
  for (int64_t s = 0; s < num_steps; ++s) {
    for (int64_t m = 0; m < M; ++m) {  // the step's position of each row, and its cache slot
      if (s > 0) ++pos[m], ++lens[m];
      slots[m] = int64_t(tables[m * W + pos[m] / block_size]) * block_size + pos[m] % block_size;
    }
    const at::Tensor logits = decode_logits(model, ids, positions, k_caches, v_caches, slot_mapping, block_tables,
                                            context_lens, lora, k_scales, v_scales);  // [M, V] bf16
    ids = nanoqwen::argmax(logits);  // [M]: each row's next token
    const at::Tensor chosen = logits.gather(1, ids.unsqueeze(1)).to(at::kFloat);  // [M, 1]: its logit
    const float* value = chosen.data_ptr<float>();
    at::Tensor step_tokens = ids.clone();
    int64_t* next = ids.data_ptr<int64_t>();
    int64_t* made = step_tokens.data_ptr<int64_t>();
    bool all_stopped = true;
    for (int64_t m = 0; m < M; ++m) {
      if (!std::isfinite(value[m])) {
        made[m] = -1, next[m] = 0, stopped[m] = true;  // (the next step feeds token 0 in its place)
      }
      stopped[m] = stopped[m] || std::find(stop + m * S, stop + (m + 1) * S, made[m]) != stop + (m + 1) * S;
      all_stopped = all_stopped && stopped[m];
    }
    tokens.push_back(step_tokens);
    if (all_stopped) break;
  }
  return at::stack(tokens);  // [steps run, M]
}

bool has_avx2() {
#ifdef NANOQWEN_AVX2
  return true;
#else
  return false;
#endif
}

bool has_bf16_dot() {
#ifdef NANOQWEN_BF16_DOT
  return true;
#else
  return false;
#endif
}

bool has_vnni() {
#if defined(NANOQWEN_AVX2) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return true;
#else
  return false;
#endif
}

}  // namespace nanoqwen

// The GIL is released while a kernel runs (it touches no Python objects), as torch's own ops do.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace nanoqwen;
  m.def("bf16_gemv", &bf16_gemv, "y = x @ w.T + bias for few rows of x (bf16, float32 accumulation)",
        py::arg("x"), py::arg("w"), py::arg("bias") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("int8_gemv", &int8_gemv, "y = (x @ q.T) * scale for few rows of x (int8 weights, float32 accumulation)",
        py::arg("x"), py::arg("q"), py::arg("scale"), py::call_guard<py::gil_scoped_release>());
  m.def("bf16_gemm", &bf16_gemm, "y = x @ w.T for many rows of x, in float32 from bf16 weights (packed panels)",
        py::arg("x"), py::arg("w"), py::call_guard<py::gil_scoped_release>());
  m.def("int8_gemm", &int8_gemm, "y = (x @ q.T) * scale for many rows of x, in float32 from int8 weights",
        py::arg("x"), py::arg("q"), py::arg("scale"), py::call_guard<py::gil_scoped_release>());
  m.def("prefill_attention", &prefill_attention, "a prompt chunk's causal attention in float32 from bf16 q, k, v "
        "(attention/attend.py prefill_attention_blocked's function)", py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("num_cached"), py::arg("scale"), py::arg("block"), py::call_guard<py::gil_scoped_release>());
  m.def("causal_softmax_", &causal_softmax_, "in place: bf16 scores [..., rows, keys] of blocks of `block` queries "
        "-> bf16(softmax) over each query's visible keys, 0 after them", py::arg("scores"), py::arg("block"),
        py::call_guard<py::gil_scoped_release>());
  m.def("fp8_gemv", &fp8_gemv, "y = x @ (w * scale).T for few rows of x (e4m3 weights, a float32 scale per row and "
        "block of inputs)", py::arg("x"), py::arg("w"), py::arg("scale"), py::call_guard<py::gil_scoped_release>());
  m.def("int8_group_gemv", &int8_group_gemv,
        "y = x @ (q * scale + offset).T for few rows of x (int8 weights, or packed at 5 or 6 bits; a scale and an "
        "offset per group, in one level or two)",
        py::arg("x"), py::arg("q"), py::arg("scale"), py::arg("offset") = py::none(),
        py::arg("super_scale") = py::none(), py::arg("super_offset") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("int8_group_dequantize", &int8_group_dequantize,
        "q * scale + offset as float32 [N, K] (int8_group_gemv's weights: int8, or packed at 5 or 6 bits)",
        py::arg("q"), py::arg("scale"), py::arg("offset"), py::arg("super_scale"), py::arg("super_offset"),
        py::arg("in_features"), py::call_guard<py::gil_scoped_release>());
  m.def("int4_gemv", &int4_gemv, "y = x @ (offset + scale * q).T for few rows of x (group-wise int4 weights); "
        "from amx_min_rows rows on (0: never) on AMX tiles where amx_int8_ready()",
        py::arg("x"), py::arg("packed"), py::arg("scale"), py::arg("offset"), py::arg("super_scale") = py::none(),
        py::arg("super_offset") = py::none(), py::arg("amx_min_rows") = 0, py::call_guard<py::gil_scoped_release>());
  m.def("int4_amx", &int4_amx, "int4_gemv's product on AMX tiles whatever the row count (needs amx_int8_ready())",
        py::arg("x"), py::arg("packed"), py::arg("scale"), py::arg("offset"), py::arg("super_scale") = py::none(),
        py::arg("super_offset") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("bf16_amx", &bf16_amx, "y = x @ w.T for bf16 x [M, K], w [N, K] on AMX-BF16 tiles (K % 32 == 0, N % 16 == 0)",
        py::arg("x"), py::arg("w"), py::call_guard<py::gil_scoped_release>());
  m.def("int8_amx", &int8_amx, "y = (x @ q.T) * scale for bf16 x [M, K], int8 q [N, K] and a bf16 scale per row on "
        "AMX-BF16 tiles (K % 32 == 0, N % 16 == 0)", py::arg("x"), py::arg("q"), py::arg("scale"),
        py::call_guard<py::gil_scoped_release>());
  m.def("amx_bf16_ready", &amx_bf16_ready, "whether this CPU has AMX-BF16 tiles and Linux lets this process use them");
  m.def("amx_int8_ready", &amx_int8_ready, "whether this CPU has AMX-INT8 tiles and Linux lets this process use them");
  m.def("set_int4_amx_min_rows", &set_int4_amx_min_rows,
        "from how many rows decode_model's int4 products run on AMX tiles (0: never)", py::arg("rows"));
  m.def("int4_gemm", &int4_gemm, "int4_gemv's product for many rows of x: packed panels, a small GEMM",
        py::arg("x"), py::arg("packed"), py::arg("scale"), py::arg("offset"), py::arg("super_scale") = py::none(),
        py::arg("super_offset") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm", &rms_norm, "models.qwen3.rms_norm for bf16 rows", py::arg("x"), py::arg("weight"),
        py::arg("eps"), py::call_guard<py::gil_scoped_release>());
  m.def("apply_rope", &apply_rope, "models.qwen3.apply_rope for bf16 x [N, H, D]", py::arg("x"), py::arg("cos"),
        py::arg("sin"), py::call_guard<py::gil_scoped_release>());
  m.def("swiglu", &swiglu, "models.qwen3.swiglu for bf16 gate_up [N, 2I]", py::arg("gate_up"),
        py::call_guard<py::gil_scoped_release>());
  m.def("argmax", &argmax, "torch.argmax(values, dim=-1) for float32 or bf16 values [B, V]", py::arg("values"),
        py::call_guard<py::gil_scoped_release>());
  m.def("top_p_threshold", &top_p_threshold, "each row's top-p threshold: the smallest positive value whose greater "
        "values sum to at most top_p", py::arg("probs"), py::arg("top_p"), py::call_guard<py::gil_scoped_release>());
  m.def("exponential_race", &exponential_race, "each row's sample: the column of the largest p / Exp(1) noise made "
        "from the row's key and the column's token id", py::arg("probs"), py::arg("token_ids"), py::arg("keys"),
        py::call_guard<py::gil_scoped_release>());
  m.def("add_rms_norm", &add_rms_norm, "h = x + y (bf16) and rms_norm(h): a residual add and the norm after it",
        py::arg("x"), py::arg("y"), py::arg("weight"), py::arg("eps"), py::call_guard<py::gil_scoped_release>());
  m.def("attention_inputs", &attention_inputs, "q, k normed and rotated, k and v stored: decode_layer's step "
        "between qkv_proj and attention", py::arg("qkv"), py::arg("q_norm"), py::arg("k_norm"), py::arg("eps"),
        py::arg("num_heads"), py::arg("cos"), py::arg("sin"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("slot_mapping"), py::arg("k_scale") = py::none(), py::arg("v_scale") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention reading the paged KV cache in place "
        "(bf16, or int8 / float8 codes with their scales)", py::arg("q"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("block_tables"), py::arg("context_lens"), py::arg("scale"), py::arg("k_scale") = py::none(),
        py::arg("v_scale") = py::none(), py::call_guard<py::gil_scoped_release>());
  // (module_local: two builds of this extension in one process each keep their own)
  py::class_<DecoderLayerWeights>(m, "DecoderLayerWeights", "a decoder layer's weights as decode_model takes them",
                                  py::module_local())
      .def(py::init([](at::Tensor input_norm, at::Tensor post_norm, double eps, LinearParts qkv_proj,
                       at::Tensor q_norm, at::Tensor k_norm, LinearParts o_proj,
                       LinearParts gate_up_proj, LinearParts down_proj, int64_t num_heads) {
             return DecoderLayerWeights{input_norm, post_norm, eps, qkv_proj, q_norm, k_norm, o_proj, gate_up_proj,
                                        down_proj, num_heads};
           }),
           py::arg("input_norm"), py::arg("post_norm"), py::arg("eps"), py::arg("qkv_proj"), py::arg("q_norm"),
           py::arg("k_norm"), py::arg("o_proj"), py::arg("gate_up_proj"), py::arg("down_proj"), py::arg("num_heads"));
  py::class_<DecoderModelWeights>(m, "DecoderModelWeights", "a model's weights as decode_model takes them",
                                  py::module_local())
      .def(py::init([](LinearPart embed, at::Tensor cos, at::Tensor sin, std::vector<DecoderLayerWeights> layers,
                       at::Tensor norm, double eps, LinearParts lm_head) {
             return DecoderModelWeights{embed, cos, sin, std::move(layers), norm, eps, lm_head};
           }),
           py::arg("embed"), py::arg("cos"), py::arg("sin"), py::arg("layers"), py::arg("norm"), py::arg("eps"),
           py::arg("lm_head"));
  py::class_<DecoderLayerLoRA>(m, "DecoderLayerLoRA", "a decoder layer's LoRA adapters as decode_model takes them",
                               py::module_local())
      .def(py::init([](LinearLoRA qkv_proj, LinearLoRA o_proj, LinearLoRA gate_up_proj, LinearLoRA down_proj) {
             for (const auto* lora : {&qkv_proj, &o_proj, &gate_up_proj, &down_proj}) {
               TORCH_CHECK(lora->empty() || (lora->size() == 2 && (*lora)[0].scalar_type() == at::kBFloat16 &&
                                             (*lora)[1].scalar_type() == at::kBFloat16 && (*lora)[0].dim() == 2 &&
                                             (*lora)[1].dim() == 2 && (*lora)[0].size(0) == (*lora)[1].size(1)),
                           "a linear's adapter is no tensors or bf16 (a [R, in], b [out, R])");
             }
             return DecoderLayerLoRA{qkv_proj, o_proj, gate_up_proj, down_proj};
           }),
           py::arg("qkv_proj"), py::arg("o_proj"), py::arg("gate_up_proj"), py::arg("down_proj"));
  py::class_<DecoderLoRAWeights>(m, "DecoderLoRAWeights", "one LoRA adapter over a model as decode_model takes it",
                                 py::module_local())
      .def(py::init([](std::vector<DecoderLayerLoRA> layers) { return DecoderLoRAWeights{std::move(layers)}; }),
           py::arg("layers"));
  m.def("decode_model", &decode_model, "a decode step's forward, input ids to float32 logits, one call a step "
        "(see worker/fused_decoder.py)", py::arg("model"), py::arg("input_ids"), py::arg("positions"), py::arg("k_caches"),
        py::arg("v_caches"), py::arg("slot_mapping"), py::arg("block_tables"), py::arg("context_lens"),
        py::arg("lora") = py::none(), py::arg("k_scales") = py::none(), py::arg("v_scales") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("decode_steps", &decode_steps, "greedy decode steps, several in one call: the tokens [steps run, M] "
        "(see worker/fused_decoder.py)", py::arg("model"), py::arg("input_ids"), py::arg("k_caches"), py::arg("v_caches"),
        py::arg("block_tables"), py::arg("context_lens"), py::arg("stop_token_ids"),
        py::arg("num_steps"), py::arg("lora") = py::none(), py::arg("k_scales") = py::none(),
        py::arg("v_scales") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("has_avx2", &has_avx2, "whether this build uses the AVX2 + FMA kernels (else the scalar loops)");
  m.def("has_vnni", &has_vnni, "whether int4_gemv's integer dot products use AVX-512 VNNI (else AVX2)");
  m.def("has_bf16_dot", &has_bf16_dot,
        "whether bf16_gemv and int8_gemv multiply with AVX-512 BF16 dot products (else widened FMAs)");
}
