// emu_cudnn.cpp: a CPU stand-in for cuDNN 9's backend (graph) API, exported
// under libcudnn.so.9's names, so that the backend's cuDNN path (fused
// attention) runs on machines without a GPU. It is a generic interpreter of
// operation graphs made of MATMUL, POINTWISE, REDUCTION and RESHAPE nodes
// over 4-D tensors [b, h, rows, cols]: finalize validates descriptors and
// graphs the way the library does (with specific messages in
// cudnnGetLastErrorString), execute runs the nodes in dependency order on
// the host, in double precision, storing every tensor in its own data type.
//
// Semantics:
//   - Device tensors address element (b,h,r,c) at b*s0 + h*s1 + r*s2 + c*s3
//     elements from their variant-pack pointer; a ragged tensor (one with a
//     RAGGED_OFFSET_DESC, an int [b+1,1,1,1] device tensor) at
//     off[b] + h*s1 + r*s2 + c*s3, its batch stride ignored. By-value
//     tensors read their data from the host pointer in the variant pack.
//   - Virtual tensors get private host storage, laid out by their declared
//     strides when those pack the tensor densely, else row-major.
//   - Every tensor carries, per batch, the rows and columns that hold valid
//     data ("rows < R, cols < C"): all of it for a dense graph input; for a
//     ragged graph input, what fits in [off[b], off[b+1]) along its ragged
//     dimension (the dimension with the largest stride); for a MATMUL output,
//     rows < M_override[b] and cols < N_override[b]; for a POINTWISE output,
//     the intersection of its inputs' (dims of size 1 broadcast and do not
//     limit); a REDUCTION output keeps its input's in the dims it keeps; a
//     RESHAPE output maps its input's through the transpose. Nodes compute
//     and write only valid elements, reductions reduce only over them, and a
//     MATMUL that would read an operand outside its valid region, or a node
//     that would write a ragged output beyond its batch's slot, fails.
//   - MATMUL broadcasts batch (size 1) and heads: an operand with h' heads
//     under an output with h (h % h' == 0) serves head i from head
//     i / (h / h'). REDUCTION reduces every dim where the output has size 1
//     and the input does not, and head groups the same way. Sums run in a
//     fixed order (deterministic).
//   - Arithmetic is IEEE double, except for the two cases a fully masked
//     softmax row meets: (-inf) - (-inf) = -inf, 0 / 0 = 0 (so such a row
//     gives zeros and a -inf log-sum-exp, never NaN).
// The heuristics offer two engines for any valid graph (global index 0 and
// 1, workspace 4096 and 8192 bytes; the workspace pointer is checked, and
// poisoned after each execution), with the numerical note NONDETERMINISTIC
// where an IDENTITY reads a device fp32 tensor that a MATMUL writes (dQ
// accumulated outside the fused kernel, with atomics on a GPU).
// DISTILL_EMU_CUDNN_REFUSE=1 makes them offer none, and
// DISTILL_EMU_CUDNN_REFUSE_FIXED=1 none for a graph with no ragged tensor;
// DISTILL_EMU_CUDNN_VERSION=N overrides cudnnGetVersion (91900). What the
// stand-in cannot tell: which graphs cuDNN's engines accept (it runs any
// graph it can interpret: mixed operand types, any node order), and
// cuDNN's own numerics.
#include "emu.h"
#include "cudnn_abi.h"
#include "emu_strf.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <vector>

namespace {

// ---------------------------------------------------------------- errors

// The last failure, for cudnnGetLastErrorString: one for the process (a
// Go caller's cgo calls may each run on a different thread; the emulator
// runs one call at a time anyway).
thread_local std::string g_last;

int fail(int code, const std::string &msg) {
	g_last = msg;
	fprintf(stderr, "emu cudnn: %s\n", msg.c_str());
	return code;
}

const char *status_name(int s) {
	switch (s) {
	case CUDNN_STATUS_SUCCESS: return "CUDNN_STATUS_SUCCESS";
	case CUDNN_STATUS_NOT_INITIALIZED: return "CUDNN_STATUS_NOT_INITIALIZED";
	case CUDNN_STATUS_BAD_PARAM: return "CUDNN_STATUS_BAD_PARAM";
	case CUDNN_STATUS_BAD_PARAM_NULL_POINTER: return "CUDNN_STATUS_BAD_PARAM_NULL_POINTER";
	case CUDNN_STATUS_NOT_SUPPORTED: return "CUDNN_STATUS_NOT_SUPPORTED";
	case CUDNN_STATUS_INTERNAL_ERROR: return "CUDNN_STATUS_INTERNAL_ERROR";
	case CUDNN_STATUS_EXECUTION_FAILED: return "CUDNN_STATUS_EXECUTION_FAILED";
	}
	return "CUDNN_STATUS_UNKNOWN (not a status the emulator returns)";
}

const char *desc_name(int t) {
	switch (t) {
	case CUDNN_BACKEND_POINTWISE_DESCRIPTOR: return "POINTWISE_DESCRIPTOR";
	case CUDNN_BACKEND_ENGINE_DESCRIPTOR: return "ENGINE_DESCRIPTOR";
	case CUDNN_BACKEND_ENGINECFG_DESCRIPTOR: return "ENGINECFG_DESCRIPTOR";
	case CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR: return "ENGINEHEUR_DESCRIPTOR";
	case CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR: return "EXECUTION_PLAN_DESCRIPTOR";
	case CUDNN_BACKEND_KNOB_CHOICE_DESCRIPTOR: return "KNOB_CHOICE_DESCRIPTOR";
	case CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR: return "OPERATION_POINTWISE_DESCRIPTOR";
	case CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR: return "OPERATIONGRAPH_DESCRIPTOR";
	case CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR: return "VARIANT_PACK_DESCRIPTOR";
	case CUDNN_BACKEND_TENSOR_DESCRIPTOR: return "TENSOR_DESCRIPTOR";
	case CUDNN_BACKEND_MATMUL_DESCRIPTOR: return "MATMUL_DESCRIPTOR";
	case CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR: return "OPERATION_MATMUL_DESCRIPTOR";
	case CUDNN_BACKEND_REDUCTION_DESCRIPTOR: return "REDUCTION_DESCRIPTOR";
	case CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR: return "OPERATION_REDUCTION_DESCRIPTOR";
	case CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR: return "OPERATION_RESHAPE_DESCRIPTOR";
	}
	return nullptr;
}

std::string desc_label(int t) {
	const char *n = desc_name(t);
	return n ? n : strf("descriptor type %d", t);
}

const char *type_name(int t) {
	switch (t) {
	case CUDNN_TYPE_HANDLE: return "CUDNN_TYPE_HANDLE";
	case CUDNN_TYPE_DATA_TYPE: return "CUDNN_TYPE_DATA_TYPE";
	case CUDNN_TYPE_BOOLEAN: return "CUDNN_TYPE_BOOLEAN";
	case CUDNN_TYPE_INT64: return "CUDNN_TYPE_INT64";
	case CUDNN_TYPE_FLOAT: return "CUDNN_TYPE_FLOAT";
	case CUDNN_TYPE_DOUBLE: return "CUDNN_TYPE_DOUBLE";
	case CUDNN_TYPE_VOID_PTR: return "CUDNN_TYPE_VOID_PTR";
	case CUDNN_TYPE_HEUR_MODE: return "CUDNN_TYPE_HEUR_MODE";
	case CUDNN_TYPE_NUMERICAL_NOTE: return "CUDNN_TYPE_NUMERICAL_NOTE";
	case CUDNN_TYPE_POINTWISE_MODE: return "CUDNN_TYPE_POINTWISE_MODE";
	case CUDNN_TYPE_BACKEND_DESCRIPTOR: return "CUDNN_TYPE_BACKEND_DESCRIPTOR";
	case CUDNN_TYPE_REDUCTION_OPERATOR_TYPE: return "CUDNN_TYPE_REDUCTION_OPERATOR_TYPE";
	case CUDNN_TYPE_BEHAVIOR_NOTE: return "CUDNN_TYPE_BEHAVIOR_NOTE";
	case CUDNN_TYPE_INT32: return "CUDNN_TYPE_INT32";
	}
	return "an attribute type the emulator does not know";
}

int type_size(int t) {
	switch (t) {
	case CUDNN_TYPE_HANDLE:
	case CUDNN_TYPE_INT64:
	case CUDNN_TYPE_DOUBLE:
	case CUDNN_TYPE_VOID_PTR:
	case CUDNN_TYPE_BACKEND_DESCRIPTOR: return 8;
	case CUDNN_TYPE_BOOLEAN: return 1; // C's bool
	default: return 4;                 // the enums, float, int32
	}
}

const char *dtype_name(int dt) {
	switch (dt) {
	case CUDNN_DATA_FLOAT: return "FLOAT";
	case CUDNN_DATA_DOUBLE: return "DOUBLE";
	case CUDNN_DATA_HALF: return "HALF";
	case CUDNN_DATA_INT32: return "INT32";
	case CUDNN_DATA_BFLOAT16: return "BFLOAT16";
	case CUDNN_DATA_INT64: return "INT64";
	case CUDNN_DATA_BOOLEAN: return "BOOLEAN";
	}
	return "an unsupported data type";
}

// dtype_size is the element size of the data types the emulator stores;
// 0 for the others.
int dtype_size(int dt) {
	switch (dt) {
	case CUDNN_DATA_FLOAT:
	case CUDNN_DATA_INT32: return 4;
	case CUDNN_DATA_DOUBLE:
	case CUDNN_DATA_INT64: return 8;
	case CUDNN_DATA_BFLOAT16: return 2;
	case CUDNN_DATA_BOOLEAN: return 1;
	}
	return 0;
}

const char *pw_name(int m) {
	switch (m) {
	case CUDNN_POINTWISE_ADD: return "ADD";
	case CUDNN_POINTWISE_MUL: return "MUL";
	case CUDNN_POINTWISE_MIN: return "MIN";
	case CUDNN_POINTWISE_MAX: return "MAX";
	case CUDNN_POINTWISE_SQRT: return "SQRT";
	case CUDNN_POINTWISE_DIV: return "DIV";
	case CUDNN_POINTWISE_SUB: return "SUB";
	case CUDNN_POINTWISE_ABS: return "ABS";
	case CUDNN_POINTWISE_EXP: return "EXP";
	case CUDNN_POINTWISE_LOG: return "LOG";
	case CUDNN_POINTWISE_NEG: return "NEG";
	case CUDNN_POINTWISE_RSQRT: return "RSQRT";
	case CUDNN_POINTWISE_IDENTITY: return "IDENTITY";
	case CUDNN_POINTWISE_RECIPROCAL: return "RECIPROCAL";
	case CUDNN_POINTWISE_CMP_EQ: return "CMP_EQ";
	case CUDNN_POINTWISE_CMP_NEQ: return "CMP_NEQ";
	case CUDNN_POINTWISE_CMP_GT: return "CMP_GT";
	case CUDNN_POINTWISE_CMP_GE: return "CMP_GE";
	case CUDNN_POINTWISE_CMP_LT: return "CMP_LT";
	case CUDNN_POINTWISE_CMP_LE: return "CMP_LE";
	case CUDNN_POINTWISE_LOGICAL_AND: return "LOGICAL_AND";
	case CUDNN_POINTWISE_LOGICAL_OR: return "LOGICAL_OR";
	case CUDNN_POINTWISE_LOGICAL_NOT: return "LOGICAL_NOT";
	case CUDNN_POINTWISE_GEN_INDEX: return "GEN_INDEX";
	case CUDNN_POINTWISE_BINARY_SELECT: return "BINARY_SELECT";
	}
	return nullptr;
}

// pw_arity: how many inputs (X, B, T) a pointwise mode takes.
int pw_arity(int m) {
	switch (m) {
	case CUDNN_POINTWISE_SQRT:
	case CUDNN_POINTWISE_ABS:
	case CUDNN_POINTWISE_EXP:
	case CUDNN_POINTWISE_LOG:
	case CUDNN_POINTWISE_NEG:
	case CUDNN_POINTWISE_RSQRT:
	case CUDNN_POINTWISE_IDENTITY:
	case CUDNN_POINTWISE_RECIPROCAL:
	case CUDNN_POINTWISE_LOGICAL_NOT:
	case CUDNN_POINTWISE_GEN_INDEX: return 1;
	case CUDNN_POINTWISE_BINARY_SELECT: return 3;
	}
	return 2;
}

// pw_scales: whether ALPHA1/ALPHA2 scale the mode's inputs (arithmetic);
// for comparisons, logic, GEN_INDEX and BINARY_SELECT they must stay 1.
bool pw_scales(int m) {
	return m < 300;
}

const char *red_name(int op) {
	switch (op) {
	case CUDNN_REDUCE_TENSOR_ADD: return "ADD";
	case CUDNN_REDUCE_TENSOR_MUL: return "MUL";
	case CUDNN_REDUCE_TENSOR_MIN: return "MIN";
	case CUDNN_REDUCE_TENSOR_MAX: return "MAX";
	}
	return nullptr;
}

// ---------------------------------------------------------------- attributes

struct Spec {
	int desc, name, type, alt; // alt: a second accepted type, or -1
	bool scalar, settable;
	const char *label;
};

#define SPEC(d, n, t, alt, scalar, settable) {CUDNN_BACKEND_##d, CUDNN_ATTR_##n, CUDNN_TYPE_##t, alt, scalar, settable, "CUDNN_ATTR_" #n}
const Spec kSpecs[] = {
    SPEC(POINTWISE_DESCRIPTOR, POINTWISE_MODE, POINTWISE_MODE, -1, true, true),
    SPEC(POINTWISE_DESCRIPTOR, POINTWISE_MATH_PREC, DATA_TYPE, -1, true, true),
    SPEC(POINTWISE_DESCRIPTOR, POINTWISE_AXIS, INT64, -1, true, true),
    SPEC(TENSOR_DESCRIPTOR, TENSOR_BYTE_ALIGNMENT, INT64, -1, true, true),
    SPEC(TENSOR_DESCRIPTOR, TENSOR_DATA_TYPE, DATA_TYPE, -1, true, true),
    SPEC(TENSOR_DESCRIPTOR, TENSOR_DIMENSIONS, INT64, -1, false, true),
    SPEC(TENSOR_DESCRIPTOR, TENSOR_STRIDES, INT64, -1, false, true),
    SPEC(TENSOR_DESCRIPTOR, TENSOR_UNIQUE_ID, INT64, -1, true, true),
    SPEC(TENSOR_DESCRIPTOR, TENSOR_IS_VIRTUAL, BOOLEAN, -1, true, true),
    SPEC(TENSOR_DESCRIPTOR, TENSOR_IS_BY_VALUE, BOOLEAN, -1, true, true),
    SPEC(TENSOR_DESCRIPTOR, TENSOR_RAGGED_OFFSET_DESC, BACKEND_DESCRIPTOR, -1, true, true),
    SPEC(MATMUL_DESCRIPTOR, MATMUL_COMP_TYPE, DATA_TYPE, -1, true, true),
    SPEC(OPERATION_MATMUL_DESCRIPTOR, OPERATION_MATMUL_ADESC, BACKEND_DESCRIPTOR, -1, true, true),
    SPEC(OPERATION_MATMUL_DESCRIPTOR, OPERATION_MATMUL_BDESC, BACKEND_DESCRIPTOR, -1, true, true),
    SPEC(OPERATION_MATMUL_DESCRIPTOR, OPERATION_MATMUL_CDESC, BACKEND_DESCRIPTOR, -1, true, true),
    SPEC(OPERATION_MATMUL_DESCRIPTOR, OPERATION_MATMUL_DESC, BACKEND_DESCRIPTOR, -1, true, true),
    SPEC(OPERATION_MATMUL_DESCRIPTOR, OPERATION_MATMUL_GEMM_M_OVERRIDE_DESC, BACKEND_DESCRIPTOR, -1, true, true),
    SPEC(OPERATION_MATMUL_DESCRIPTOR, OPERATION_MATMUL_GEMM_N_OVERRIDE_DESC, BACKEND_DESCRIPTOR, -1, true, true),
    SPEC(OPERATION_MATMUL_DESCRIPTOR, OPERATION_MATMUL_GEMM_K_OVERRIDE_DESC, BACKEND_DESCRIPTOR, -1, true, true),
    SPEC(REDUCTION_DESCRIPTOR, REDUCTION_OPERATOR, REDUCTION_OPERATOR_TYPE, -1, true, true),
    SPEC(REDUCTION_DESCRIPTOR, REDUCTION_COMP_TYPE, DATA_TYPE, -1, true, true),
    SPEC(REDUCTION_DESCRIPTOR, REDUCTION_IS_DETERMINISTIC, BOOLEAN, -1, true, true),
    SPEC(OPERATION_REDUCTION_DESCRIPTOR, OPERATION_REDUCTION_XDESC, BACKEND_DESCRIPTOR, -1, true, true),
    SPEC(OPERATION_REDUCTION_DESCRIPTOR, OPERATION_REDUCTION_YDESC, BACKEND_DESCRIPTOR, -1, true, true),
    SPEC(OPERATION_REDUCTION_DESCRIPTOR, OPERATION_REDUCTION_DESC, BACKEND_DESCRIPTOR, -1, true, true),
    SPEC(OPERATION_POINTWISE_DESCRIPTOR, OPERATION_POINTWISE_PW_DESCRIPTOR, BACKEND_DESCRIPTOR, -1, true, true),
    SPEC(OPERATION_POINTWISE_DESCRIPTOR, OPERATION_POINTWISE_XDESC, BACKEND_DESCRIPTOR, -1, true, true),
    SPEC(OPERATION_POINTWISE_DESCRIPTOR, OPERATION_POINTWISE_BDESC, BACKEND_DESCRIPTOR, -1, true, true),
    SPEC(OPERATION_POINTWISE_DESCRIPTOR, OPERATION_POINTWISE_YDESC, BACKEND_DESCRIPTOR, -1, true, true),
    SPEC(OPERATION_POINTWISE_DESCRIPTOR, OPERATION_POINTWISE_TDESC, BACKEND_DESCRIPTOR, -1, true, true),
    SPEC(OPERATION_POINTWISE_DESCRIPTOR, OPERATION_POINTWISE_ALPHA1, FLOAT, CUDNN_TYPE_DOUBLE, true, true),
    SPEC(OPERATION_POINTWISE_DESCRIPTOR, OPERATION_POINTWISE_ALPHA2, FLOAT, CUDNN_TYPE_DOUBLE, true, true),
    SPEC(OPERATION_RESHAPE_DESCRIPTOR, OPERATION_RESHAPE_XDESC, BACKEND_DESCRIPTOR, -1, true, true),
    SPEC(OPERATION_RESHAPE_DESCRIPTOR, OPERATION_RESHAPE_YDESC, BACKEND_DESCRIPTOR, -1, true, true),
    SPEC(OPERATIONGRAPH_DESCRIPTOR, OPERATIONGRAPH_HANDLE, HANDLE, -1, true, true),
    SPEC(OPERATIONGRAPH_DESCRIPTOR, OPERATIONGRAPH_OPS, BACKEND_DESCRIPTOR, -1, false, true),
    SPEC(ENGINEHEUR_DESCRIPTOR, ENGINEHEUR_MODE, HEUR_MODE, -1, true, true),
    SPEC(ENGINEHEUR_DESCRIPTOR, ENGINEHEUR_OPERATION_GRAPH, BACKEND_DESCRIPTOR, -1, true, true),
    SPEC(ENGINEHEUR_DESCRIPTOR, ENGINEHEUR_RESULTS, BACKEND_DESCRIPTOR, -1, false, false),
    SPEC(ENGINECFG_DESCRIPTOR, ENGINECFG_ENGINE, BACKEND_DESCRIPTOR, -1, true, true),
    SPEC(ENGINECFG_DESCRIPTOR, ENGINECFG_WORKSPACE_SIZE, INT64, -1, true, false),
    SPEC(ENGINE_DESCRIPTOR, ENGINE_OPERATION_GRAPH, BACKEND_DESCRIPTOR, -1, true, true),
    SPEC(ENGINE_DESCRIPTOR, ENGINE_GLOBAL_INDEX, INT64, -1, true, true),
    SPEC(ENGINE_DESCRIPTOR, ENGINE_NUMERICAL_NOTE, NUMERICAL_NOTE, -1, false, false),
    SPEC(ENGINE_DESCRIPTOR, ENGINE_BEHAVIOR_NOTE, BEHAVIOR_NOTE, -1, false, false),
    SPEC(EXECUTION_PLAN_DESCRIPTOR, EXECUTION_PLAN_HANDLE, HANDLE, -1, true, true),
    SPEC(EXECUTION_PLAN_DESCRIPTOR, EXECUTION_PLAN_ENGINE_CONFIG, BACKEND_DESCRIPTOR, -1, true, true),
    SPEC(EXECUTION_PLAN_DESCRIPTOR, EXECUTION_PLAN_WORKSPACE_SIZE, INT64, -1, true, false),
    SPEC(VARIANT_PACK_DESCRIPTOR, VARIANT_PACK_UNIQUE_IDS, INT64, -1, false, true),
    SPEC(VARIANT_PACK_DESCRIPTOR, VARIANT_PACK_DATA_POINTERS, VOID_PTR, -1, false, true),
    SPEC(VARIANT_PACK_DESCRIPTOR, VARIANT_PACK_WORKSPACE, VOID_PTR, -1, true, true),
};
#undef SPEC

const Spec *find_spec(int desc, int name) {
	for (const Spec &s : kSpecs)
		if (s.desc == desc && s.name == name) return &s;
	return nullptr;
}

std::string attr_label(int name) {
	for (const Spec &s : kSpecs)
		if (s.name == name) return s.label;
	return strf("attribute %d", name);
}

// ---------------------------------------------------------------- objects

struct TensorInfo {
	u64 serial = 0; // which finalized descriptor this is
	i64 uid = 0;
	int dtype = 0;
	i64 dims[4] = {1, 1, 1, 1}, st[4] = {1, 1, 1, 1};
	i64 align = 0;
	bool virt = false, byval = false;
	std::shared_ptr<const TensorInfo> ragged;
};
typedef std::shared_ptr<const TensorInfo> TP;

std::string tname(const TensorInfo &t) {
	std::string s = strf("uid %lld %s[%lld,%lld,%lld,%lld]", (long long)t.uid, dtype_name(t.dtype), (long long)t.dims[0],
	                     (long long)t.dims[1], (long long)t.dims[2], (long long)t.dims[3]);
	if (t.virt) s += " virtual";
	if (t.byval) s += " by-value";
	if (t.ragged) s += strf(" ragged by uid %lld", (long long)t.ragged->uid);
	return s;
}
std::string tname(const TP &t) { return t ? tname(*t) : "(none)"; }

std::string dims_str(const i64 *d) {
	return strf("[%lld,%lld,%lld,%lld]", (long long)d[0], (long long)d[1], (long long)d[2], (long long)d[3]);
}

struct OpInfo {
	int kind = 0;  // the operation's descriptor type
	int mode = 0;  // pointwise mode, or reduction operator
	i64 axis = -1; // GEN_INDEX
	double alpha1 = 1, alpha2 = 1;
	// Pointwise: x, b, t -> y. Matmul: x (A), b (B), overrides mo, no, ko
	// -> y (C). Reduction and reshape: x -> y.
	TP x, b, t, y, mo, no, ko;
};

std::string op_kind(const OpInfo &op) {
	switch (op.kind) {
	case CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR: return "MATMUL";
	case CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR: return std::string("POINTWISE ") + pw_name(op.mode);
	case CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR: return std::string("REDUCTION ") + red_name(op.mode);
	case CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR: return "RESHAPE";
	}
	return "?";
}

// A node of a finalized graph: the operation and its tensors as indices
// into Graph::tensors.
struct Node {
	std::shared_ptr<const OpInfo> op;
	int user = 0; // its index in the caller's OPERATIONGRAPH_OPS
	int x = -1, b = -1, t = -1, y = -1, mo = -1, no = -1, ko = -1;
	std::string name() const { return strf("op %d (%s)", user, op_kind(*op).c_str()); }
};

struct Graph {
	std::vector<Node> nodes; // in execution order
	std::vector<TP> tensors;
	std::vector<int> ragged;   // per tensor: its ragged offsets' index, or -1
	std::vector<int> producer; // per tensor: the node that writes it, or -1
	std::vector<int> last_use; // per tensor: the last node that reads it, or -1
	bool nondet = false;       // dQ accumulated through a device fp32 tensor
};

struct Engine {
	std::shared_ptr<const Graph> graph;
	i64 index = 0, ws = 0;
	std::vector<int> notes;
};

struct Attr {
	int type = 0;
	i64 count = 0;
	std::vector<unsigned char> bytes;
};

struct Desc {
	int type = 0;
	bool finalized = false;
	std::map<int, Attr> attrs;
	TP tensor;                            // TENSOR
	std::shared_ptr<const OpInfo> op;     // OPERATION_*
	int mode = 0, prec = 0;               // POINTWISE, MATMUL, REDUCTION
	i64 axis = -1;                        // POINTWISE
	std::shared_ptr<const Graph> graph;   // OPERATIONGRAPH, ENGINEHEUR
	std::shared_ptr<const Engine> engine; // ENGINE, ENGINECFG, EXECUTION_PLAN
	void *handle = nullptr;               // EXECUTION_PLAN
	std::vector<i64> uids;                // VARIANT_PACK
	std::vector<void *> ptrs;
	void *ws = nullptr;
};

struct Handle {
	void *stream = nullptr;
};

std::set<Desc *> g_descs;
std::set<Handle *> g_handles;
u64 g_serial;

Desc *live(void *p) {
	Desc *d = (Desc *)p;
	return g_descs.count(d) ? d : nullptr;
}

const Attr *attr(const Desc *d, int name) {
	auto it = d->attrs.find(name);
	return it == d->attrs.end() ? nullptr : &it->second;
}
bool attr_i64(const Desc *d, int name, i64 *v) {
	const Attr *a = attr(d, name);
	if (!a) return false;
	memcpy(v, a->bytes.data(), 8);
	return true;
}
bool attr_int(const Desc *d, int name, int *v) {
	const Attr *a = attr(d, name);
	if (!a) return false;
	memcpy(v, a->bytes.data(), 4);
	return true;
}
bool attr_bool(const Desc *d, int name, bool *v) {
	const Attr *a = attr(d, name);
	if (!a) return false;
	*v = a->bytes[0] != 0;
	return true;
}
bool attr_real(const Desc *d, int name, double *v) {
	const Attr *a = attr(d, name);
	if (!a) return false;
	if (a->type == CUDNN_TYPE_DOUBLE) memcpy(v, a->bytes.data(), 8);
	else {
		float f;
		memcpy(&f, a->bytes.data(), 4);
		*v = f;
	}
	return true;
}
std::vector<i64> attr_i64s(const Desc *d, int name) {
	const Attr *a = attr(d, name);
	std::vector<i64> v;
	if (a) {
		v.resize(a->count);
		memcpy(v.data(), a->bytes.data(), a->count * 8);
	}
	return v;
}

std::string where(const Desc *d) { return "cudnnBackendFinalize(" + desc_label(d->type) + ")"; }

int missing(const Desc *d, int name) {
	return fail(CUDNN_STATUS_BAD_PARAM, strf("%s: the required attribute %s is not set", where(d).c_str(), attr_label(name).c_str()));
}

// ref resolves a descriptor-valued attribute to a live, finalized
// descriptor of type want. *out stays null when the attribute is not set
// and not required.
int ref(const Desc *d, int name, int want, bool required, Desc **out) {
	*out = nullptr;
	const Attr *a = attr(d, name);
	if (!a) return required ? missing(d, name) : 0;
	void *p;
	memcpy(&p, a->bytes.data(), 8);
	Desc *r = live(p);
	if (!r)
		return fail(CUDNN_STATUS_BAD_PARAM, strf("%s: %s is %p, which is not a live descriptor (never created, or destroyed)",
		                                         where(d).c_str(), attr_label(name).c_str(), p));
	if (r->type != want)
		return fail(CUDNN_STATUS_BAD_PARAM, strf("%s: %s is a %s, want a %s", where(d).c_str(), attr_label(name).c_str(),
		                                         desc_label(r->type).c_str(), desc_label(want).c_str()));
	if (!r->finalized)
		return fail(CUDNN_STATUS_BAD_PARAM, strf("%s: %s (%s %p) is not finalized", where(d).c_str(), attr_label(name).c_str(),
		                                         desc_label(r->type).c_str(), p));
	*out = r;
	return 0;
}

int ref_tensor(const Desc *d, int name, bool required, TP *out) {
	Desc *r;
	if (int s = ref(d, name, CUDNN_BACKEND_TENSOR_DESCRIPTOR, required, &r)) return s;
	*out = r ? r->tensor : nullptr;
	return 0;
}

// ---------------------------------------------------------------- finalize: tensors and operations

bool packed(const TensorInfo &t) {
	std::vector<int> ks;
	for (int k = 0; k < 4; k++)
		if (t.dims[k] > 1) ks.push_back(k);
	std::sort(ks.begin(), ks.end(), [&](int a, int b) { return t.st[a] < t.st[b]; });
	i64 run = 1;
	for (int k : ks) {
		if (t.st[k] != run) return false;
		run *= t.dims[k];
	}
	return true;
}

int fin_tensor(Desc *d) {
	auto t = std::make_shared<TensorInfo>();
	std::string w = where(d);
	if (!attr_int(d, CUDNN_ATTR_TENSOR_DATA_TYPE, &t->dtype)) return missing(d, CUDNN_ATTR_TENSOR_DATA_TYPE);
	const Attr *dims = attr(d, CUDNN_ATTR_TENSOR_DIMENSIONS), *st = attr(d, CUDNN_ATTR_TENSOR_STRIDES);
	if (!dims) return missing(d, CUDNN_ATTR_TENSOR_DIMENSIONS);
	if (!st) return missing(d, CUDNN_ATTR_TENSOR_STRIDES);
	if (!attr_i64(d, CUDNN_ATTR_TENSOR_UNIQUE_ID, &t->uid)) return missing(d, CUDNN_ATTR_TENSOR_UNIQUE_ID);
	std::string who = strf("%s (uid %lld)", w.c_str(), (long long)t->uid);
	if (!attr_i64(d, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, &t->align)) return missing(d, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT);
	if (dims->count != 4)
		return fail(CUDNN_STATUS_BAD_PARAM, strf("%s: CUDNN_ATTR_TENSOR_DIMENSIONS has %lld entries; the emulator takes 4-D tensors "
		                                         "[batch, heads, rows, cols]",
		                                         who.c_str(), (long long)dims->count));
	if (st->count != dims->count)
		return fail(CUDNN_STATUS_BAD_PARAM, strf("%s: CUDNN_ATTR_TENSOR_STRIDES has %lld entries but CUDNN_ATTR_TENSOR_DIMENSIONS has %lld",
		                                         who.c_str(), (long long)st->count, (long long)dims->count));
	memcpy(t->dims, dims->bytes.data(), 32);
	memcpy(t->st, st->bytes.data(), 32);
	for (int k = 0; k < 4; k++) {
		if (t->dims[k] < 1)
			return fail(CUDNN_STATUS_BAD_PARAM, strf("%s: dimension %d is %lld (dims %s)", who.c_str(), k, (long long)t->dims[k],
			                                         dims_str(t->dims).c_str()));
		if (t->st[k] < 1)
			return fail(CUDNN_STATUS_BAD_PARAM, strf("%s: stride %d is %lld (strides %s); strides must be positive", who.c_str(), k,
			                                         (long long)t->st[k], dims_str(t->st).c_str()));
	}
	if (!dtype_size(t->dtype))
		return fail(CUDNN_STATUS_NOT_SUPPORTED, strf("%s: data type %d is not emulated (FLOAT, DOUBLE, BFLOAT16, INT32, INT64, BOOLEAN are)",
		                                             who.c_str(), t->dtype));
	if (t->align < 1 || (t->align & (t->align - 1)) != 0)
		return fail(CUDNN_STATUS_BAD_PARAM, strf("%s: CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT %lld is not a power of two", who.c_str(),
		                                         (long long)t->align));
	attr_bool(d, CUDNN_ATTR_TENSOR_IS_VIRTUAL, &t->virt);
	attr_bool(d, CUDNN_ATTR_TENSOR_IS_BY_VALUE, &t->byval);
	if (t->virt && t->byval) return fail(CUDNN_STATUS_BAD_PARAM, who + ": a tensor cannot be both virtual and by-value");
	if (t->byval && t->dims[0] * t->dims[1] * t->dims[2] * t->dims[3] != 1)
		return fail(CUDNN_STATUS_NOT_SUPPORTED, strf("%s: a by-value tensor must be a scalar (dims %s)", who.c_str(), dims_str(t->dims).c_str()));
	Desc *r;
	if (int s = ref(d, CUDNN_ATTR_TENSOR_RAGGED_OFFSET_DESC, CUDNN_BACKEND_TENSOR_DESCRIPTOR, false, &r)) return s;
	if (r) {
		const TensorInfo &o = *r->tensor;
		if (t->byval) return fail(CUDNN_STATUS_BAD_PARAM, who + ": a by-value tensor cannot be ragged");
		if (o.dtype != CUDNN_DATA_INT32 && o.dtype != CUDNN_DATA_INT64)
			return fail(CUDNN_STATUS_BAD_PARAM, strf("%s: its ragged offsets (%s) must be INT32 or INT64", who.c_str(), tname(o).c_str()));
		if (o.virt || o.byval || o.ragged)
			return fail(CUDNN_STATUS_BAD_PARAM, strf("%s: its ragged offsets (%s) must be a plain device tensor (not virtual, "
			                                         "by-value or ragged)",
			                                         who.c_str(), tname(o).c_str()));
		if (o.dims[0] != t->dims[0] + 1 || o.dims[1] != 1 || o.dims[2] != 1 || o.dims[3] != 1)
			return fail(CUDNN_STATUS_BAD_PARAM, strf("%s: its ragged offsets (%s) must have dims [%lld,1,1,1] (batch + 1)", who.c_str(),
			                                         tname(o).c_str(), (long long)t->dims[0] + 1));
		t->ragged = r->tensor;
	}
	t->serial = ++g_serial;
	d->tensor = t;
	return 0;
}

bool emulated_dtype_for_math(int dt) {
	return dt == CUDNN_DATA_FLOAT || dt == CUDNN_DATA_DOUBLE || dt == CUDNN_DATA_INT32 || dt == CUDNN_DATA_INT64 ||
	       dt == CUDNN_DATA_BOOLEAN || dt == CUDNN_DATA_BFLOAT16;
}

int fin_pointwise_desc(Desc *d) {
	if (!attr_int(d, CUDNN_ATTR_POINTWISE_MODE, &d->mode)) return missing(d, CUDNN_ATTR_POINTWISE_MODE);
	if (!attr_int(d, CUDNN_ATTR_POINTWISE_MATH_PREC, &d->prec)) return missing(d, CUDNN_ATTR_POINTWISE_MATH_PREC);
	if (!pw_name(d->mode))
		return fail(CUDNN_STATUS_NOT_SUPPORTED, strf("%s: pointwise mode %d is not emulated", where(d).c_str(), d->mode));
	if (!emulated_dtype_for_math(d->prec))
		return fail(CUDNN_STATUS_NOT_SUPPORTED, strf("%s: CUDNN_ATTR_POINTWISE_MATH_PREC %d is not emulated", where(d).c_str(), d->prec));
	d->axis = -1;
	attr_i64(d, CUDNN_ATTR_POINTWISE_AXIS, &d->axis);
	if (d->mode == CUDNN_POINTWISE_GEN_INDEX && (d->axis < 0 || d->axis > 3))
		return fail(CUDNN_STATUS_BAD_PARAM, strf("%s: GEN_INDEX needs CUDNN_ATTR_POINTWISE_AXIS in 0..3 (%s)", where(d).c_str(),
		                                         attr(d, CUDNN_ATTR_POINTWISE_AXIS) ? strf("it is %lld", (long long)d->axis).c_str() : "not set"));
	return 0;
}

int fin_matmul_desc(Desc *d) {
	if (!attr_int(d, CUDNN_ATTR_MATMUL_COMP_TYPE, &d->prec)) return missing(d, CUDNN_ATTR_MATMUL_COMP_TYPE);
	if (d->prec != CUDNN_DATA_FLOAT)
		return fail(CUDNN_STATUS_NOT_SUPPORTED, strf("%s: CUDNN_ATTR_MATMUL_COMP_TYPE is %s; the emulator (like the attention engines) "
		                                             "computes in FLOAT",
		                                             where(d).c_str(), dtype_name(d->prec)));
	return 0;
}

int fin_reduction_desc(Desc *d) {
	if (!attr_int(d, CUDNN_ATTR_REDUCTION_OPERATOR, &d->mode)) return missing(d, CUDNN_ATTR_REDUCTION_OPERATOR);
	if (!attr_int(d, CUDNN_ATTR_REDUCTION_COMP_TYPE, &d->prec)) return missing(d, CUDNN_ATTR_REDUCTION_COMP_TYPE);
	if (!red_name(d->mode))
		return fail(CUDNN_STATUS_NOT_SUPPORTED, strf("%s: reduction operator %d is not emulated (ADD, MUL, MIN, MAX are)", where(d).c_str(), d->mode));
	if (d->prec != CUDNN_DATA_FLOAT)
		return fail(CUDNN_STATUS_NOT_SUPPORTED, strf("%s: CUDNN_ATTR_REDUCTION_COMP_TYPE is %s; the emulator computes in FLOAT",
		                                             where(d).c_str(), dtype_name(d->prec)));
	return 0;
}

int not_output(const Desc *d, const char *role, const TP &y) {
	if (y->byval) return fail(CUDNN_STATUS_BAD_PARAM, strf("%s: the output %s (%s) is by-value", where(d).c_str(), role, tname(y).c_str()));
	return 0;
}

int fin_op_pointwise(Desc *d) {
	auto op = std::make_shared<OpInfo>();
	op->kind = d->type;
	Desc *pw;
	if (int s = ref(d, CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, CUDNN_BACKEND_POINTWISE_DESCRIPTOR, true, &pw)) return s;
	op->mode = pw->mode;
	op->axis = pw->axis;
	if (int s = ref_tensor(d, CUDNN_ATTR_OPERATION_POINTWISE_XDESC, true, &op->x)) return s;
	if (int s = ref_tensor(d, CUDNN_ATTR_OPERATION_POINTWISE_YDESC, true, &op->y)) return s;
	if (int s = ref_tensor(d, CUDNN_ATTR_OPERATION_POINTWISE_BDESC, false, &op->b)) return s;
	if (int s = ref_tensor(d, CUDNN_ATTR_OPERATION_POINTWISE_TDESC, false, &op->t)) return s;
	std::string w = where(d) + " " + pw_name(op->mode);
	int n = pw_arity(op->mode);
	if (n >= 2 && !op->b)
		return fail(CUDNN_STATUS_BAD_PARAM, strf("%s: the mode takes %d inputs but CUDNN_ATTR_OPERATION_POINTWISE_BDESC is not set", w.c_str(), n));
	if (n < 2 && op->b)
		return fail(CUDNN_STATUS_BAD_PARAM, strf("%s: the mode takes one input but CUDNN_ATTR_OPERATION_POINTWISE_BDESC is set (%s)",
		                                         w.c_str(), tname(op->b).c_str()));
	if (n == 3 && !op->t)
		return fail(CUDNN_STATUS_BAD_PARAM, w + ": the mode takes a condition but CUDNN_ATTR_OPERATION_POINTWISE_TDESC is not set");
	if (n < 3 && op->t)
		return fail(CUDNN_STATUS_BAD_PARAM, strf("%s: CUDNN_ATTR_OPERATION_POINTWISE_TDESC is set (%s), but only BINARY_SELECT takes one",
		                                         w.c_str(), tname(op->t).c_str()));
	if (op->t && op->t->dtype != CUDNN_DATA_BOOLEAN)
		return fail(CUDNN_STATUS_BAD_PARAM, strf("%s: the condition T (%s) must be BOOLEAN", w.c_str(), tname(op->t).c_str()));
	attr_real(d, CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1, &op->alpha1);
	attr_real(d, CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2, &op->alpha2);
	if (!pw_scales(op->mode) && (op->alpha1 != 1 || op->alpha2 != 1))
		return fail(CUDNN_STATUS_NOT_SUPPORTED, strf("%s: ALPHA1 %g and ALPHA2 %g: the emulator scales only arithmetic modes' inputs", w.c_str(),
		                                             op->alpha1, op->alpha2));
	if (int s = not_output(d, "Y", op->y)) return s;
	const TensorInfo &y = *op->y;
	if (op->mode == CUDNN_POINTWISE_GEN_INDEX) {
		for (int k = 0; k < 4; k++)
			if (op->x->dims[k] != y.dims[k])
				return fail(CUDNN_STATUS_BAD_PARAM, strf("%s: Y (%s) must have X's dims (%s)", w.c_str(), tname(y).c_str(), tname(op->x).c_str()));
	} else {
		const TP ins[3] = {op->x, op->b, op->t};
		for (int k = 0; k < 4; k++) {
			i64 want = 1;
			for (const TP &in : ins)
				if (in) want = std::max(want, in->dims[k]);
			bool ok = y.dims[k] == want;
			for (const TP &in : ins)
				if (in && in->dims[k] != 1 && in->dims[k] != want) ok = false;
			if (!ok) {
				std::string s = strf("%s: the inputs do not broadcast to Y in dimension %d: X %s", w.c_str(), k, tname(op->x).c_str());
				if (op->b) s += ", B " + tname(op->b);
				if (op->t) s += ", T " + tname(op->t);
				s += ", Y " + tname(y) + " (each input's size must be 1 or Y's, and Y's the largest)";
				return fail(CUDNN_STATUS_BAD_PARAM, s);
			}
		}
	}
	d->op = op;
	return 0;
}

int fin_op_matmul(Desc *d) {
	auto op = std::make_shared<OpInfo>();
	op->kind = d->type;
	Desc *md;
	if (int s = ref(d, CUDNN_ATTR_OPERATION_MATMUL_DESC, CUDNN_BACKEND_MATMUL_DESCRIPTOR, true, &md)) return s;
	if (int s = ref_tensor(d, CUDNN_ATTR_OPERATION_MATMUL_ADESC, true, &op->x)) return s;
	if (int s = ref_tensor(d, CUDNN_ATTR_OPERATION_MATMUL_BDESC, true, &op->b)) return s;
	if (int s = ref_tensor(d, CUDNN_ATTR_OPERATION_MATMUL_CDESC, true, &op->y)) return s;
	if (int s = ref_tensor(d, CUDNN_ATTR_OPERATION_MATMUL_GEMM_M_OVERRIDE_DESC, false, &op->mo)) return s;
	if (int s = ref_tensor(d, CUDNN_ATTR_OPERATION_MATMUL_GEMM_N_OVERRIDE_DESC, false, &op->no)) return s;
	if (int s = ref_tensor(d, CUDNN_ATTR_OPERATION_MATMUL_GEMM_K_OVERRIDE_DESC, false, &op->ko)) return s;
	std::string w = where(d);
	const TensorInfo &a = *op->x, &b = *op->b, &c = *op->y;
	std::string shapes = strf("A %s, B %s, C %s", tname(a).c_str(), tname(b).c_str(), tname(c).c_str());
	if (int s = not_output(d, "C", op->y)) return s;
	if (a.byval || b.byval) return fail(CUDNN_STATUS_BAD_PARAM, w + ": a by-value operand: " + shapes);
	if (a.dims[3] != b.dims[2] || a.dims[2] != c.dims[2] || b.dims[3] != c.dims[3])
		return fail(CUDNN_STATUS_BAD_PARAM, w + ": the shapes do not multiply (A [.,.,M,K] times B [.,.,K,N] gives C [.,.,M,N]): " + shapes);
	for (const TensorInfo *o : {&a, &b}) {
		if (o->dims[0] != c.dims[0] && o->dims[0] != 1)
			return fail(CUDNN_STATUS_BAD_PARAM, w + ": an operand's batch must be C's or 1: " + shapes);
		if (c.dims[1] % o->dims[1] != 0)
			return fail(CUDNN_STATUS_BAD_PARAM, w + ": an operand's heads must divide C's: " + shapes);
	}
	if (c.dtype != CUDNN_DATA_FLOAT && c.dtype != CUDNN_DATA_BFLOAT16)
		return fail(CUDNN_STATUS_NOT_SUPPORTED, w + ": C must be FLOAT or BFLOAT16: " + shapes);
	const std::pair<const TP *, const char *> ovs[3] = {{&op->mo, "GEMM_M_OVERRIDE"}, {&op->no, "GEMM_N_OVERRIDE"}, {&op->ko, "GEMM_K_OVERRIDE"}};
	for (auto &ov : ovs) {
		const TP &o = *ov.first;
		if (!o) continue;
		if ((o->dtype != CUDNN_DATA_INT32 && o->dtype != CUDNN_DATA_INT64) || (o->dims[0] != c.dims[0] && o->dims[0] != 1) ||
		    o->dims[1] != 1 || o->dims[2] != 1 || o->dims[3] != 1 || o->ragged)
			return fail(CUDNN_STATUS_BAD_PARAM, strf("%s: the %s tensor (%s) must be an INT32 [%lld,1,1,1] tensor (one size per batch of C)",
			                                         w.c_str(), ov.second, tname(o).c_str(), (long long)c.dims[0]));
	}
	d->op = op;
	return 0;
}

int fin_op_reduction(Desc *d) {
	auto op = std::make_shared<OpInfo>();
	op->kind = d->type;
	Desc *rd;
	if (int s = ref(d, CUDNN_ATTR_OPERATION_REDUCTION_DESC, CUDNN_BACKEND_REDUCTION_DESCRIPTOR, true, &rd)) return s;
	op->mode = rd->mode;
	if (int s = ref_tensor(d, CUDNN_ATTR_OPERATION_REDUCTION_XDESC, true, &op->x)) return s;
	if (int s = ref_tensor(d, CUDNN_ATTR_OPERATION_REDUCTION_YDESC, true, &op->y)) return s;
	if (int s = not_output(d, "Y", op->y)) return s;
	const TensorInfo &x = *op->x, &y = *op->y;
	for (int k = 0; k < 4; k++) {
		bool ok = k == 1 ? x.dims[1] % y.dims[1] == 0 : (y.dims[k] == x.dims[k] || y.dims[k] == 1);
		if (!ok)
			return fail(CUDNN_STATUS_BAD_PARAM, strf("%s: Y (%s) is not a reduction of X (%s) in dimension %d (each of Y's dims must be "
			                                         "X's or 1, and Y's heads must divide X's)",
			                                         where(d).c_str(), tname(y).c_str(), tname(x).c_str(), k));
	}
	d->op = op;
	return 0;
}

int fin_op_reshape(Desc *d) {
	auto op = std::make_shared<OpInfo>();
	op->kind = d->type;
	if (int s = ref_tensor(d, CUDNN_ATTR_OPERATION_RESHAPE_XDESC, true, &op->x)) return s;
	if (int s = ref_tensor(d, CUDNN_ATTR_OPERATION_RESHAPE_YDESC, true, &op->y)) return s;
	const TensorInfo &x = *op->x, &y = *op->y;
	std::string w = where(d) + strf(" X %s, Y %s", tname(x).c_str(), tname(y).c_str());
	if (!y.virt) return fail(CUDNN_STATUS_NOT_SUPPORTED, w + ": the emulator takes only a virtual Y (a view of X's memory)");
	if (y.dims[0] != x.dims[0]) return fail(CUDNN_STATUS_NOT_SUPPORTED, w + ": Y must keep X's batch");
	if (x.byval) return fail(CUDNN_STATUS_BAD_PARAM, w + ": X is by-value");
	if (x.virt) {
		if (!packed(x))
			return fail(CUDNN_STATUS_NOT_SUPPORTED, w + strf(": X is virtual and its strides %s do not pack its dims densely, so Y's "
			                                                  "strides cannot be resolved against its memory",
			                                                  dims_str(x.st).c_str()));
		if (y.ragged) return fail(CUDNN_STATUS_NOT_SUPPORTED, w + ": Y is ragged but X is virtual (it has no ragged memory to view)");
	}
	d->op = op;
	return 0;
}

// ---------------------------------------------------------------- finalize: graphs

bool same_tensor(const TensorInfo &a, const TensorInfo &b) {
	return a.uid == b.uid && a.dtype == b.dtype && !memcmp(a.dims, b.dims, sizeof a.dims) && !memcmp(a.st, b.st, sizeof a.st) &&
	       a.virt == b.virt && a.byval == b.byval && !a.ragged && !b.ragged;
}

int fin_graph(Desc *d) {
	std::string w = where(d);
	const Attr *h = attr(d, CUDNN_ATTR_OPERATIONGRAPH_HANDLE);
	if (!h) return missing(d, CUDNN_ATTR_OPERATIONGRAPH_HANDLE);
	void *hp;
	memcpy(&hp, h->bytes.data(), 8);
	if (!g_handles.count((Handle *)hp))
		return fail(CUDNN_STATUS_BAD_PARAM, strf("%s: CUDNN_ATTR_OPERATIONGRAPH_HANDLE %p is not a handle from cudnnCreate", w.c_str(), hp));
	const Attr *ops = attr(d, CUDNN_ATTR_OPERATIONGRAPH_OPS);
	if (!ops || ops->count == 0) return missing(d, CUDNN_ATTR_OPERATIONGRAPH_OPS);
	auto g = std::make_shared<Graph>();
	std::vector<Node> nodes;
	for (i64 i = 0; i < ops->count; i++) {
		void *p;
		memcpy(&p, ops->bytes.data() + 8 * i, 8);
		Desc *o = live(p);
		if (!o)
			return fail(CUDNN_STATUS_BAD_PARAM, strf("%s: CUDNN_ATTR_OPERATIONGRAPH_OPS[%lld] is %p, not a live descriptor", w.c_str(), (long long)i, p));
		if (!o->op)
			return fail(CUDNN_STATUS_BAD_PARAM, strf("%s: CUDNN_ATTR_OPERATIONGRAPH_OPS[%lld] is a %s%s, want a finalized operation", w.c_str(),
			                                         (long long)i, desc_label(o->type).c_str(), o->finalized ? "" : " (not finalized)"));
		Node n;
		n.op = o->op;
		n.user = (int)i;
		nodes.push_back(n);
	}
	// The graph's tensors: one per finalized tensor descriptor (serial).
	// Two descriptors may share a uid only as identical ragged-offset
	// tensors.
	std::map<u64, int> by_serial;
	std::map<i64, int> by_uid;
	std::vector<std::string> first_use;
	std::vector<bool> operand; // used by an operation (not only as ragged offsets)
	auto add = [&](const TP &t, const std::string &use, bool is_operand, int *idx) -> int {
		auto it = by_serial.find(t->serial);
		if (it != by_serial.end()) {
			*idx = it->second;
			if (is_operand) operand[*idx] = true;
			return 0;
		}
		auto u = by_uid.find(t->uid);
		if (u != by_uid.end()) {
			const TensorInfo &o = *g->tensors[u->second];
			if (!is_operand && !operand[u->second] && same_tensor(o, *t)) {
				by_serial[t->serial] = *idx = u->second;
				return 0;
			}
			return fail(CUDNN_STATUS_BAD_PARAM, strf("%s: two different tensor descriptors have uid %lld: %s (%s) and %s (%s)", w.c_str(),
			                                         (long long)t->uid, tname(o).c_str(), first_use[u->second].c_str(), tname(*t).c_str(), use.c_str()));
		}
		*idx = (int)g->tensors.size();
		g->tensors.push_back(t);
		first_use.push_back(use);
		operand.push_back(is_operand);
		by_serial[t->serial] = *idx;
		by_uid[t->uid] = *idx;
		return 0;
	};
	for (Node &n : nodes) {
		const OpInfo &op = *n.op;
		bool mm = op.kind == CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR;
		const std::tuple<const TP *, int *, const char *> roles[] = {
		    {&op.x, &n.x, mm ? "A" : "X"}, {&op.b, &n.b, "B"},  {&op.t, &n.t, "T"}, {&op.y, &n.y, mm ? "C" : "Y"},
		    {&op.mo, &n.mo, "M override"}, {&op.no, &n.no, "N override"}, {&op.ko, &n.ko, "K override"}};
		for (auto &r : roles) {
			const TP &t = *std::get<0>(r);
			if (!t) continue;
			if (int s = add(t, n.name() + " " + std::get<2>(r), true, std::get<1>(r))) return s;
		}
	}
	size_t nops = g->tensors.size();
	g->ragged.assign(nops, -1);
	for (size_t i = 0; i < nops; i++) {
		const TP t = g->tensors[i];
		if (!t->ragged) continue;
		int idx;
		if (int s = add(t->ragged, "ragged offsets of uid " + std::to_string(t->uid), false, &idx)) return s;
		g->ragged[i] = idx;
	}
	size_t nt = g->tensors.size();
	g->ragged.resize(nt, -1);
	// Producers, and the dependencies between nodes.
	g->producer.assign(nt, -1);
	for (size_t i = 0; i < nodes.size(); i++) {
		int y = nodes[i].y;
		const TensorInfo &t = *g->tensors[y];
		if (g->producer[y] >= 0)
			return fail(CUDNN_STATUS_BAD_PARAM, strf("%s: tensor %s is the output of both %s and %s", w.c_str(), tname(t).c_str(),
			                                         nodes[g->producer[y]].name().c_str(), nodes[i].name().c_str()));
		g->producer[y] = (int)i;
	}
	for (size_t i = nops; i < nt; i++)
		if (g->producer[i] >= 0) return fail(CUDNN_STATUS_INTERNAL_ERROR, w + ": a ragged offsets tensor is produced");
	for (size_t t = 0; t < nops; t++) {
		if (g->producer[t] >= 0 || !g->tensors[t]->virt) continue;
		// A virtual tensor no node writes: name its first reader.
		for (const Node &n : nodes)
			for (int in : {n.x, n.b, n.t, n.mo, n.no, n.ko})
				if (in == (int)t)
					return fail(CUDNN_STATUS_BAD_PARAM, strf("%s: %s reads the virtual tensor %s, which no operation of the graph produces "
					                                         "(an operand used before it is produced)",
					                                         w.c_str(), n.name().c_str(), tname(g->tensors[t]).c_str()));
	}
	for (size_t t = 0; t < nt; t++) {
		const TensorInfo &ti = *g->tensors[t];
		int p = g->producer[t];
		if (p >= 0 && nodes[p].op->kind == CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR) continue;
		if (ti.ragged && ti.virt && p >= 0)
			return fail(CUDNN_STATUS_NOT_SUPPORTED, strf("%s: %s is virtual and ragged; only a RESHAPE's Y may be", w.c_str(), tname(ti).c_str()));
	}
	// Topological order: repeatedly the first node (in the caller's order)
	// whose inputs are all written.
	std::vector<bool> done(nodes.size(), false), ready(nt, true);
	for (size_t t = 0; t < nt; t++)
		if (g->producer[t] >= 0) ready[t] = false;
	while (g->nodes.size() < nodes.size()) {
		bool progress = false;
		for (size_t i = 0; i < nodes.size(); i++) {
			if (done[i]) continue;
			const Node &n = nodes[i];
			bool ok = true;
			for (int in : {n.x, n.b, n.t, n.mo, n.no, n.ko})
				if (in >= 0 && !ready[in]) ok = false;
			if (!ok) continue;
			done[i] = true;
			ready[n.y] = true;
			g->nodes.push_back(n);
			progress = true;
			break;
		}
		if (!progress) {
			std::string s;
			for (size_t i = 0; i < nodes.size(); i++)
				if (!done[i]) s += (s.empty() ? "" : ", ") + nodes[i].name();
			return fail(CUDNN_STATUS_BAD_PARAM, strf("%s: the operations %s depend on each other's outputs (a cycle)", w.c_str(), s.c_str()));
		}
	}
	for (size_t i = 0; i < g->nodes.size(); i++) g->producer[g->nodes[i].y] = (int)i;
	g->last_use.assign(nt, -1);
	for (size_t i = 0; i < g->nodes.size(); i++) {
		const Node &n = g->nodes[i];
		for (int in : {n.x, n.b, n.t, n.mo, n.no, n.ko})
			if (in >= 0) g->last_use[in] = (int)i;
	}
	// The "dQ accumulator" design: a MATMUL writes a device fp32 tensor that
	// an IDENTITY converts; cuDNN's engines for it add to the accumulator
	// with atomics, in no fixed order.
	for (const Node &n : g->nodes) {
		if (n.op->kind != CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR || n.op->mode != CUDNN_POINTWISE_IDENTITY) continue;
		const TensorInfo &x = *g->tensors[n.x];
		int p = g->producer[n.x];
		if (!x.virt && x.dtype == CUDNN_DATA_FLOAT && p >= 0 && g->nodes[p].op->kind == CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR) g->nondet = true;
	}
	d->graph = g;
	return 0;
}

bool env_on(const char *name) {
	const char *v = getenv(name);
	return v && *v && strcmp(v, "0") != 0;
}

// refused reports whether the heuristics offer no engine for g:
// DISTILL_EMU_CUDNN_REFUSE for any graph, DISTILL_EMU_CUDNN_REFUSE_FIXED for
// one with no ragged tensor (a batch of samples of one length, as the
// backend builds it; the tests of its fallback to the ragged graph).
bool refused(const Graph &g) {
	if (env_on("DISTILL_EMU_CUDNN_REFUSE")) return true;
	return env_on("DISTILL_EMU_CUDNN_REFUSE_FIXED") && std::all_of(g.ragged.begin(), g.ragged.end(), [](int r) { return r < 0; });
}

std::shared_ptr<const Engine> make_engine(const std::shared_ptr<const Graph> &g, i64 index) {
	auto e = std::make_shared<Engine>();
	e->graph = g;
	e->index = index;
	e->ws = index == 0 ? 4096 : 8192;
	if (g->nondet) e->notes.push_back(CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC);
	return e;
}
const i64 kEngines = 2;

int fin_heur(Desc *d) {
	int mode;
	if (!attr_int(d, CUDNN_ATTR_ENGINEHEUR_MODE, &mode)) return missing(d, CUDNN_ATTR_ENGINEHEUR_MODE);
	if (mode < 0 || mode > 3) return fail(CUDNN_STATUS_BAD_PARAM, strf("%s: heuristics mode %d", where(d).c_str(), mode));
	Desc *g;
	if (int s = ref(d, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, true, &g)) return s;
	d->graph = g->graph;
	return 0;
}

int fin_engine(Desc *d) {
	Desc *g;
	if (int s = ref(d, CUDNN_ATTR_ENGINE_OPERATION_GRAPH, CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, true, &g)) return s;
	i64 idx;
	if (!attr_i64(d, CUDNN_ATTR_ENGINE_GLOBAL_INDEX, &idx)) return missing(d, CUDNN_ATTR_ENGINE_GLOBAL_INDEX);
	if (refused(*g->graph))
		return fail(CUDNN_STATUS_NOT_SUPPORTED, where(d) + ": no engine supports the graph (DISTILL_EMU_CUDNN_REFUSE or _REFUSE_FIXED is set)");
	if (idx < 0 || idx >= kEngines)
		return fail(CUDNN_STATUS_NOT_SUPPORTED, strf("%s: engine %lld does not exist (the emulator has engines 0 and 1)", where(d).c_str(), (long long)idx));
	d->engine = make_engine(g->graph, idx);
	return 0;
}

int fin_cfg(Desc *d) {
	Desc *e;
	if (int s = ref(d, CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_BACKEND_ENGINE_DESCRIPTOR, true, &e)) return s;
	d->engine = e->engine;
	return 0;
}

int fin_plan(Desc *d) {
	Desc *c;
	if (int s = ref(d, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, true, &c)) return s;
	if (!c->engine) return fail(CUDNN_STATUS_BAD_PARAM, where(d) + ": the engine config holds no engine");
	d->handle = nullptr;
	if (const Attr *h = attr(d, CUDNN_ATTR_EXECUTION_PLAN_HANDLE)) {
		memcpy(&d->handle, h->bytes.data(), 8);
		if (!g_handles.count((Handle *)d->handle))
			return fail(CUDNN_STATUS_BAD_PARAM, strf("%s: CUDNN_ATTR_EXECUTION_PLAN_HANDLE %p is not a handle from cudnnCreate", where(d).c_str(), d->handle));
	}
	d->engine = c->engine;
	return 0;
}

int fin_pack(Desc *d) {
	const Attr *u = attr(d, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS), *p = attr(d, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS);
	if (!u) return missing(d, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS);
	if (!p) return missing(d, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS);
	if (u->count != p->count)
		return fail(CUDNN_STATUS_BAD_PARAM, strf("%s: %lld unique ids but %lld data pointers", where(d).c_str(), (long long)u->count, (long long)p->count));
	d->uids = attr_i64s(d, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS);
	d->ptrs.resize(p->count);
	memcpy(d->ptrs.data(), p->bytes.data(), p->count * 8);
	std::set<i64> seen;
	for (i64 id : d->uids)
		if (!seen.insert(id).second)
			return fail(CUDNN_STATUS_BAD_PARAM, strf("%s: uid %lld appears twice in CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS", where(d).c_str(), (long long)id));
	d->ws = nullptr;
	if (const Attr *ws = attr(d, CUDNN_ATTR_VARIANT_PACK_WORKSPACE)) memcpy(&d->ws, ws->bytes.data(), 8);
	return 0;
}

// ---------------------------------------------------------------- execution

float to_float(u16 h) {
	u32 u = (u32)h << 16;
	float f;
	memcpy(&f, &u, 4);
	return f;
}

double ldv(int dt, const char *p) {
	switch (dt) {
	case CUDNN_DATA_FLOAT: {
		float f;
		memcpy(&f, p, 4);
		return f;
	}
	case CUDNN_DATA_DOUBLE: {
		double f;
		memcpy(&f, p, 8);
		return f;
	}
	case CUDNN_DATA_BFLOAT16: {
		u16 h;
		memcpy(&h, p, 2);
		return to_float(h);
	}
	case CUDNN_DATA_INT32: {
		int32_t v;
		memcpy(&v, p, 4);
		return v;
	}
	case CUDNN_DATA_INT64: {
		int64_t v;
		memcpy(&v, p, 8);
		return (double)v;
	}
	case CUDNN_DATA_BOOLEAN: return *(const unsigned char *)p != 0;
	}
	return NAN;
}

void stv(int dt, char *p, double v) {
	switch (dt) {
	case CUDNN_DATA_FLOAT: {
		float f = (float)v;
		memcpy(p, &f, 4);
		return;
	}
	case CUDNN_DATA_DOUBLE: memcpy(p, &v, 8); return;
	case CUDNN_DATA_BFLOAT16: {
		u16 h = emu_f2bf((float)v);
		memcpy(p, &h, 2);
		return;
	}
	case CUDNN_DATA_INT32: {
		int32_t i = std::isnan(v) ? 0 : v >= 2147483647.0 ? INT32_MAX : v <= -2147483648.0 ? INT32_MIN : (int32_t)v;
		memcpy(p, &i, 4);
		return;
	}
	case CUDNN_DATA_INT64: {
		int64_t i = std::isnan(v) ? 0 : v >= 9.2e18 ? INT64_MAX : v <= -9.2e18 ? INT64_MIN : (int64_t)v;
		memcpy(p, &i, 8);
		return;
	}
	case CUDNN_DATA_BOOLEAN: *(unsigned char *)p = v != 0; return;
	}
}

typedef std::array<i64, 2> Lim; // valid rows, cols

// A tensor during one execution.
struct RT {
	const TensorInfo *ti = nullptr;
	char *base = nullptr;
	std::vector<unsigned char> store; // a virtual tensor's storage
	i64 st[4] = {0, 0, 0, 0};         // addressing strides, elements
	std::vector<i64> roff;            // ragged offsets (device tensors; a RESHAPE's Y: the ones it views X with)
	std::vector<Lim> lim;             // per batch: the valid region
	std::vector<Lim> slot;            // per batch: what the ragged offsets hold
	int esz = 0;
	bool priv = false, host = false;

	i64 boff(i64 b) const { return (priv || roff.empty()) ? b * st[0] : roff[b]; }
	i64 off(i64 b, i64 h, i64 r, i64 c) const { return boff(b) + h * st[1] + r * st[2] + c * st[3]; }
	double get(i64 b, i64 h, i64 r, i64 c) const { return ldv(ti->dtype, base + off(b, h, r, c) * esz); }
	void put(i64 b, i64 h, i64 r, i64 c, double v) { stv(ti->dtype, base + off(b, h, r, c) * esz, v); }
	const i64 *dims() const { return ti->dims; }
};

// ragged_slot: the rows and columns of batch b that lie in
// [roff[b], roff[b+1]), along the ragged dimension (among heads, rows and
// cols of size > 1, the one with the largest stride; rows on ties).
bool ragged_slot(const i64 *dims, const i64 *st, const std::vector<i64> &roff, i64 b, Lim *lim, std::string *why) {
	i64 span = roff[b + 1] - roff[b];
	int rd = -1;
	for (int k : {2, 3, 1})
		if (dims[k] > 1 && (rd < 0 || st[k] > st[rd])) rd = k;
	if (rd < 0) rd = 2;
	i64 inner = 1;
	for (int k = 1; k < 4; k++)
		if (k != rd) inner += (dims[k] - 1) * st[k];
	i64 n = span < inner ? 0 : std::min(dims[rd], (span - inner) / st[rd] + 1);
	*lim = {dims[2], dims[3]};
	if (rd == 1) {
		if (n < dims[1]) {
			*why = strf("batch %lld's ragged span of %lld elements holds only %lld of its %lld heads", (long long)b, (long long)span, (long long)n,
			            (long long)dims[1]);
			return false;
		}
	} else
		(*lim)[rd - 2] = n;
	return true;
}

struct Exec {
	const Graph &g;
	std::vector<RT> rt;
	explicit Exec(const Graph &g) : g(g), rt(g.tensors.size()) {}

	std::string tn(int i) const { return tname(*g.tensors[i]); }

	int xfail(const std::string &msg) { return fail(CUDNN_STATUS_EXECUTION_FAILED, "cudnnBackendExecute: " + msg); }

	// region checks the device extent of batch b's rows < rows, cols < cols
	// (all heads) of tensor i.
	int region(int i, i64 b, i64 rows, i64 cols, const std::string &who) {
		RT &t = rt[i];
		if (t.priv || t.host || rows <= 0 || cols <= 0) return 0;
		const i64 *d = t.dims();
		i64 lo = t.boff(b), hi = lo + (d[1] - 1) * t.st[1] + (rows - 1) * t.st[2] + (cols - 1) * t.st[3];
		char why[300];
		if (lo < 0) snprintf(why, sizeof why, "a negative offset %lld", (long long)lo);
		else if (emu_range_ok((u64)(t.base + lo * t.esz), (size_t)(hi - lo + 1) * t.esz, why, sizeof why))
			return 0;
		return xfail(strf("%s %s, batch %lld (rows < %lld, cols < %lld: elements %lld..%lld from its pointer %p): %s", who.c_str(),
		                  tn(i).c_str(), (long long)b, (long long)rows, (long long)cols, (long long)lo, (long long)hi, (void *)t.base, why));
	}

	// alloc gives a virtual tensor its storage, laid out by its strides
	// when they pack it, else row-major.
	void alloc(int i) {
		RT &t = rt[i];
		const TensorInfo &ti = *t.ti;
		i64 n = ti.dims[0] * ti.dims[1] * ti.dims[2] * ti.dims[3];
		t.store.assign((size_t)(n * t.esz), 0xff); // poison: NaN, -1, true
		t.base = (char *)t.store.data();
		if (packed(ti)) memcpy(t.st, ti.st, sizeof t.st);
		else {
			t.st[3] = 1;
			t.st[2] = ti.dims[3];
			t.st[1] = ti.dims[2] * ti.dims[3];
			t.st[0] = ti.dims[1] * ti.dims[2] * ti.dims[3];
		}
	}

	// begin_write prepares output y of node n for writing rows < rows,
	// cols < cols of batch b: a device output must hold them within its
	// allocation and, if ragged, within the batch's slot.
	int begin_write(const Node &n, int y, i64 b, i64 rows, i64 cols) {
		RT &t = rt[y];
		if (t.priv || rows <= 0 || cols <= 0) return 0;
		if (!t.slot.empty() && (rows > t.slot[b][0] || cols > t.slot[b][1])) {
			const std::vector<i64> &o = t.roff;
			return xfail(strf("%s would write rows < %lld, cols < %lld of batch %lld of %s, but its ragged offsets (%lld..%lld) give that "
			                  "batch only rows < %lld, cols < %lld: it would overwrite the next sample",
			                  n.name().c_str(), (long long)rows, (long long)cols, (long long)b, tn(y).c_str(), (long long)o[b], (long long)o[b + 1],
			                  (long long)t.slot[b][0], (long long)t.slot[b][1]));
		}
		return region(y, b, rows, cols, n.name() + " writes");
	}

	int bind(const Desc *pack, i64 ws_size) {
		std::map<i64, void *> ptr;
		for (size_t i = 0; i < pack->uids.size(); i++) ptr[pack->uids[i]] = pack->ptrs[i];
		std::set<i64> used;
		for (size_t i = 0; i < g.tensors.size(); i++) {
			RT &t = rt[i];
			t.ti = g.tensors[i].get();
			t.esz = dtype_size(t.ti->dtype);
			t.lim.assign(t.ti->dims[0], Lim{0, 0});
			if (t.ti->virt) {
				t.priv = true;
				continue;
			}
			auto it = ptr.find(t.ti->uid);
			if (it == ptr.end())
				return fail(CUDNN_STATUS_BAD_PARAM, strf("cudnnBackendExecute: the variant pack has no pointer for %s", tn((int)i).c_str()));
			used.insert(t.ti->uid);
			void *p = it->second;
			if (!p) return fail(CUDNN_STATUS_BAD_PARAM_NULL_POINTER, strf("cudnnBackendExecute: the variant pack's pointer for %s is NULL", tn((int)i).c_str()));
			t.base = (char *)p;
			memcpy(t.st, t.ti->st, sizeof t.st);
			char why[300];
			if (t.ti->byval) {
				t.host = true;
				if (emu_range_ok((u64)p, 1, why, sizeof why))
					return fail(CUDNN_STATUS_BAD_PARAM, strf("cudnnBackendExecute: the pointer %p for by-value %s points into device memory; "
					                                         "by-value data is read from the host",
					                                         p, tn((int)i).c_str()));
			} else if ((uintptr_t)p % (uintptr_t)t.ti->align != 0)
				return fail(CUDNN_STATUS_BAD_PARAM, strf("cudnnBackendExecute: the pointer %p for %s is not aligned to its "
				                                         "CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT of %lld bytes",
				                                         p, tn((int)i).c_str(), (long long)t.ti->align));
		}
		for (i64 id : pack->uids)
			if (!used.count(id))
				return fail(CUDNN_STATUS_BAD_PARAM, strf("cudnnBackendExecute: the variant pack names uid %lld, which is no device tensor of the graph", (long long)id));
		if (ws_size > 0) {
			char why[300];
			if (!pack->ws)
				return fail(CUDNN_STATUS_BAD_PARAM, strf("cudnnBackendExecute: the plan needs %lld bytes of workspace but "
				                                         "CUDNN_ATTR_VARIANT_PACK_WORKSPACE is not set",
				                                         (long long)ws_size));
			if (!emu_range_ok((u64)pack->ws, (size_t)ws_size, why, sizeof why))
				return xfail(strf("the workspace (%p, the plan needs %lld bytes): %s", pack->ws, (long long)ws_size, why));
		}
		// Ragged offsets, read once per offsets tensor.
		std::map<int, std::vector<i64>> offs;
		for (size_t i = 0; i < g.tensors.size(); i++) {
			int r = g.ragged[i];
			if (r < 0) continue;
			if (!offs.count(r)) {
				RT &o = rt[r];
				i64 n = o.dims()[0];
				char why[300];
				i64 hi = (n - 1) * o.st[0];
				if (!emu_range_ok((u64)o.base, (size_t)(hi + 1) * o.esz, why, sizeof why))
					return xfail(strf("the ragged offsets %s (%lld values, stride %lld): %s", tn(r).c_str(), (long long)n, (long long)o.st[0], why));
				std::vector<i64> v(n);
				for (i64 k = 0; k < n; k++) {
					v[k] = (i64)ldv(o.ti->dtype, o.base + k * o.st[0] * o.esz);
					if (v[k] < 0 || (k > 0 && v[k] < v[k - 1]))
						return xfail(strf("the ragged offsets %s are not non-negative and non-decreasing: offset[%lld] = %lld%s", tn(r).c_str(),
						                  (long long)k, (long long)v[k],
						                  k > 0 ? strf(" after offset[%lld] = %lld", (long long)k - 1, (long long)v[k - 1]).c_str() : ""));
				}
				offs[r] = v;
			}
			RT &t = rt[i];
			t.roff = offs[r];
			if (t.priv) continue; // a RESHAPE's Y: used when it runs
			t.slot.resize(t.dims()[0]);
			for (i64 b = 0; b < t.dims()[0]; b++) {
				std::string why;
				if (!ragged_slot(t.dims(), t.st, t.roff, b, &t.slot[b], &why)) return xfail(tn((int)i) + ": " + why);
			}
		}
		// Graph inputs: valid where they hold data; check their extent.
		for (size_t i = 0; i < g.tensors.size(); i++) {
			RT &t = rt[i];
			if (t.priv || g.producer[i] >= 0) continue;
			for (i64 b = 0; b < t.dims()[0]; b++) {
				t.lim[b] = t.slot.empty() ? Lim{t.dims()[2], t.dims()[3]} : t.slot[b];
				if (offs.count((int)i)) continue; // checked above
				if (int s = region((int)i, b, t.lim[b][0], t.lim[b][1], "the input")) return s;
			}
		}
		return 0;
	}

	// narrow: the valid rows and cols of input i seen from output batch b
	// (size-1 dims broadcast and do not limit).
	void narrow(int i, i64 b, i64 *rows, i64 *cols) {
		if (i < 0) return;
		const RT &t = rt[i];
		i64 bi = t.dims()[0] == 1 ? 0 : b;
		if (t.dims()[2] > 1) *rows = std::min(*rows, t.lim[bi][0]);
		if (t.dims()[3] > 1) *cols = std::min(*cols, t.lim[bi][1]);
	}

	int pointwise(const Node &n) {
		const OpInfo &op = *n.op;
		RT &y = rt[n.y];
		const i64 *D = y.dims();
		if (y.priv) alloc(n.y);
		const RT *in[3] = {&rt[n.x], n.b >= 0 ? &rt[n.b] : nullptr, n.t >= 0 ? &rt[n.t] : nullptr};
		i64 bc[3][4]; // per input: 1 where the input broadcasts that dim
		for (int j = 0; j < 3; j++)
			for (int k = 0; k < 4; k++) bc[j][k] = in[j] && in[j]->dims()[k] == D[k];
		const double a1 = op.alpha1, a2 = op.alpha2;
		for (i64 b = 0; b < D[0]; b++) {
			i64 R = D[2], C = D[3];
			narrow(n.x, b, &R, &C);
			if (op.mode != CUDNN_POINTWISE_GEN_INDEX) {
				narrow(n.b, b, &R, &C);
				narrow(n.t, b, &R, &C);
			}
			if (int s = begin_write(n, n.y, b, R, C)) return s;
			for (i64 h = 0; h < D[1]; h++)
				for (i64 r = 0; r < R; r++)
					for (i64 c = 0; c < C; c++) {
						double v[3] = {0, 0, 0};
						for (int j = 0; j < 3; j++)
							if (in[j] && !(op.mode == CUDNN_POINTWISE_GEN_INDEX))
								v[j] = in[j]->get(b * bc[j][0], h * bc[j][1], r * bc[j][2], c * bc[j][3]);
						double x = v[0], bb = v[1], o;
						if (pw_scales(op.mode)) {
							x *= a1;
							bb *= a2;
						}
						switch (op.mode) {
						case CUDNN_POINTWISE_ADD: o = x + bb; break;
						case CUDNN_POINTWISE_SUB: o = (x == -INFINITY && bb == -INFINITY) ? -INFINITY : x - bb; break;
						case CUDNN_POINTWISE_MUL: o = x * bb; break;
						case CUDNN_POINTWISE_DIV: o = (x == 0 && bb == 0) ? 0 : x / bb; break;
						case CUDNN_POINTWISE_MIN: o = std::min(x, bb); break;
						case CUDNN_POINTWISE_MAX: o = std::max(x, bb); break;
						case CUDNN_POINTWISE_SQRT: o = std::sqrt(x); break;
						case CUDNN_POINTWISE_ABS: o = std::fabs(x); break;
						case CUDNN_POINTWISE_EXP: o = std::exp(x); break;
						case CUDNN_POINTWISE_LOG: o = std::log(x); break;
						case CUDNN_POINTWISE_NEG: o = -x; break;
						case CUDNN_POINTWISE_RSQRT: o = 1 / std::sqrt(x); break;
						case CUDNN_POINTWISE_IDENTITY: o = x; break;
						case CUDNN_POINTWISE_RECIPROCAL: o = 1 / x; break;
						case CUDNN_POINTWISE_CMP_EQ: o = x == bb; break;
						case CUDNN_POINTWISE_CMP_NEQ: o = x != bb; break;
						case CUDNN_POINTWISE_CMP_GT: o = x > bb; break;
						case CUDNN_POINTWISE_CMP_GE: o = x >= bb; break;
						case CUDNN_POINTWISE_CMP_LT: o = x < bb; break;
						case CUDNN_POINTWISE_CMP_LE: o = x <= bb; break;
						case CUDNN_POINTWISE_LOGICAL_AND: o = (x != 0) && (bb != 0); break;
						case CUDNN_POINTWISE_LOGICAL_OR: o = (x != 0) || (bb != 0); break;
						case CUDNN_POINTWISE_LOGICAL_NOT: o = x == 0; break;
						case CUDNN_POINTWISE_GEN_INDEX: {
							const i64 idx[4] = {b, h, r, c};
							o = (double)idx[op.axis];
							break;
						}
						case CUDNN_POINTWISE_BINARY_SELECT: o = v[2] != 0 ? x : bb; break;
						default: return fail(CUDNN_STATUS_INTERNAL_ERROR, n.name() + ": mode not implemented");
						}
						y.put(b, h, r, c, o);
					}
			y.lim[b] = {R, C};
		}
		return 0;
	}

	int reduction(const Node &n) {
		const OpInfo &op = *n.op;
		RT &x = rt[n.x], &y = rt[n.y];
		const i64 *X = x.dims(), *Y = y.dims();
		if (y.priv) alloc(n.y);
		i64 G = X[1] / Y[1];
		double init = op.mode == CUDNN_REDUCE_TENSOR_ADD ? 0 : op.mode == CUDNN_REDUCE_TENSOR_MUL ? 1
		                                                   : op.mode == CUDNN_REDUCE_TENSOR_MAX   ? -INFINITY
		                                                                                          : INFINITY;
		for (i64 yb = 0; yb < Y[0]; yb++) {
			i64 b0 = Y[0] == 1 ? 0 : yb, b1 = Y[0] == 1 ? X[0] : yb + 1;
			i64 R = Y[2], C = Y[3];
			for (i64 b = b0; b < b1; b++) {
				if (Y[2] > 1) R = std::min(R, x.lim[b][0]);
				if (Y[3] > 1) C = std::min(C, x.lim[b][1]);
			}
			if (int s = begin_write(n, n.y, yb, R, C)) return s;
			std::vector<double> acc((size_t)(Y[1] * R * C), init);
			for (i64 b = b0; b < b1; b++) {
				i64 XR = Y[2] == 1 ? x.lim[b][0] : R, XC = Y[3] == 1 ? x.lim[b][1] : C;
				for (i64 h = 0; h < X[1]; h++)
					for (i64 r = 0; r < XR; r++)
						for (i64 c = 0; c < XC; c++) {
							double v = x.get(b, h, r, c);
							double &a = acc[(size_t)(((h / G) * R + (Y[2] == 1 ? 0 : r)) * C + (Y[3] == 1 ? 0 : c))];
							switch (op.mode) {
							case CUDNN_REDUCE_TENSOR_ADD: a += v; break;
							case CUDNN_REDUCE_TENSOR_MUL: a *= v; break;
							case CUDNN_REDUCE_TENSOR_MAX:
								if (v > a) a = v;
								break;
							default:
								if (v < a) a = v;
							}
						}
			}
			for (i64 h = 0; h < Y[1]; h++)
				for (i64 r = 0; r < R; r++)
					for (i64 c = 0; c < C; c++) y.put(yb, h, r, c, acc[(size_t)((h * R + r) * C + c)]);
			y.lim[yb] = {R, C};
		}
		return 0;
	}

	// override reads a GEMM size override for batch b, or returns def.
	int override_size(const Node &n, int i, const char *what, i64 b, i64 def, i64 *out) {
		*out = def;
		if (i < 0) return 0;
		const RT &t = rt[i];
		i64 v = (i64)t.get(t.dims()[0] == 1 ? 0 : b, 0, 0, 0);
		if (v < 0 || v > def)
			return xfail(strf("%s: the %s (%s) for batch %lld is %lld, outside 0..%lld", n.name().c_str(), what, tn(i).c_str(), (long long)b,
			                  (long long)v, (long long)def));
		*out = v;
		return 0;
	}

	int matmul(const Node &n) {
		RT &A = rt[n.x], &B = rt[n.b], &Cm = rt[n.y];
		const i64 *Ad = A.dims(), *Bd = B.dims(), *Cd = Cm.dims();
		if (Cm.priv) alloc(n.y);
		std::vector<double> pa, pb;
		for (i64 b = 0; b < Cd[0]; b++) {
			i64 M, N, K;
			if (int s = override_size(n, n.mo, "M override", b, Cd[2], &M)) return s;
			if (int s = override_size(n, n.no, "N override", b, Cd[3], &N)) return s;
			if (int s = override_size(n, n.ko, "K override", b, Ad[3], &K)) return s;
			i64 ab = Ad[0] == 1 ? 0 : b, bb = Bd[0] == 1 ? 0 : b;
			if ((M > 0 && K > 0 && (A.lim[ab][0] < M || A.lim[ab][1] < K)) || (K > 0 && N > 0 && (B.lim[bb][0] < K || B.lim[bb][1] < N))) {
				bool isA = M > 0 && K > 0 && (A.lim[ab][0] < M || A.lim[ab][1] < K);
				const RT &o = isA ? A : B;
				i64 ob = isA ? ab : bb;
				return xfail(strf("%s: %s %s holds valid data in batch %lld only in rows < %lld, cols < %lld (%s), but the GEMM reads rows < "
				                  "%lld, cols < %lld there (M %lld, N %lld, K %lld%s)",
				                  n.name().c_str(), isA ? "A" : "B", tn(isA ? n.x : n.b).c_str(), (long long)ob, (long long)o.lim[ob][0],
				                  (long long)o.lim[ob][1],
				                  g.producer[isA ? n.x : n.b] >= 0 ? "what its producer wrote" : "what its ragged offsets give that batch",
				                  (long long)(isA ? M : K), (long long)(isA ? K : N), (long long)M, (long long)N, (long long)K,
				                  (n.mo >= 0 || n.no >= 0 || n.ko >= 0) ? ", after the overrides" : "; no override limits them"));
			}
			if (int s = begin_write(n, n.y, b, M, N)) return s;
			for (i64 h = 0; h < Cd[1]; h++) {
				i64 ah = h / (Cd[1] / Ad[1]), bh = h / (Cd[1] / Bd[1]);
				pa.resize((size_t)(M * K));
				pb.resize((size_t)(N * K));
				for (i64 m = 0; m < M; m++)
					for (i64 k = 0; k < K; k++) pa[(size_t)(m * K + k)] = A.get(ab, ah, m, k);
				for (i64 k = 0; k < K; k++)
					for (i64 j = 0; j < N; j++) pb[(size_t)(j * K + k)] = B.get(bb, bh, k, j);
				for (i64 m = 0; m < M; m++)
					for (i64 j = 0; j < N; j++) {
						const double *ra = &pa[(size_t)(m * K)], *rb = &pb[(size_t)(j * K)];
						double acc = 0;
						for (i64 k = 0; k < K; k++) acc += ra[k] * rb[k];
						Cm.put(b, h, m, j, acc);
					}
			}
			Cm.lim[b] = {M, N};
		}
		return 0;
	}

	int reshape(const Node &n) {
		RT &x = rt[n.x], &y = rt[n.y];
		const TensorInfo &xt = *x.ti, &yt = *y.ti;
		const i64 *Y = yt.dims;
		alloc(n.y);
		// Y views X's memory through its own strides (in X's elements) and
		// its own ragged offsets, or X's.
		const std::vector<i64> &ro = !y.roff.empty() ? y.roff : x.priv ? y.roff : x.roff;
		for (i64 b = 0; b < Y[0]; b++) {
			// Valid region: X's, through the transpose.
			i64 L[2] = {Y[2], Y[3]};
			bool xfull = x.lim[b][0] == xt.dims[2] && x.lim[b][1] == xt.dims[3];
			bool mapped[2] = {false, false};
			for (int k = 2; k < 4; k++)
				for (int j = 2; j < 4; j++)
					if (!mapped[j - 2] && xt.st[j] == yt.st[k] && xt.dims[j] == Y[k]) {
						L[k - 2] = x.lim[b][j - 2];
						mapped[j - 2] = true;
						break;
					}
			if (!xfull && ((x.lim[b][0] < xt.dims[2] && !mapped[0]) || (x.lim[b][1] < xt.dims[3] && !mapped[1])))
				return xfail(strf("%s: X %s holds valid data in batch %lld only in rows < %lld, cols < %lld, and Y %s is not a transpose of it, "
				                  "so the emulator cannot tell which of Y's elements are valid",
				                  n.name().c_str(), tn(n.x).c_str(), (long long)b, (long long)x.lim[b][0], (long long)x.lim[b][1], tn(n.y).c_str()));
			if (!ro.empty()) {
				Lim s;
				std::string why;
				if (!ragged_slot(Y, yt.st, ro, b, &s, &why)) return xfail(n.name() + ": Y " + tn(n.y) + ": " + why);
				L[0] = std::min(L[0], s[0]);
				L[1] = std::min(L[1], s[1]);
			}
			i64 R = L[0], C = L[1];
			y.lim[b] = {R, C};
			if (R <= 0 || C <= 0) continue;
			i64 lo = ro.empty() ? b * yt.st[0] : ro[b];
			i64 hi = lo + (Y[1] - 1) * yt.st[1] + (R - 1) * yt.st[2] + (C - 1) * yt.st[3];
			i64 xel = (i64)x.store.size() / x.esz;
			if (x.priv) {
				if (lo < 0 || hi >= xel)
					return xfail(strf("%s: Y %s reads elements %lld..%lld of batch %lld, outside X %s (%lld elements)", n.name().c_str(),
					                  tn(n.y).c_str(), (long long)lo, (long long)hi, (long long)b, tn(n.x).c_str(), (long long)xel));
			} else {
				char why[300];
				if (!emu_range_ok((u64)(x.base + lo * x.esz), (size_t)(hi - lo + 1) * x.esz, why, sizeof why))
					return xfail(strf("%s: Y %s views elements %lld..%lld of X %s in batch %lld: %s", n.name().c_str(), tn(n.y).c_str(),
					                  (long long)lo, (long long)hi, tn(n.x).c_str(), (long long)b, why));
			}
			for (i64 h = 0; h < Y[1]; h++)
				for (i64 r = 0; r < R; r++)
					for (i64 c = 0; c < C; c++) {
						i64 o = lo + h * yt.st[1] + r * yt.st[2] + c * yt.st[3];
						y.put(b, h, r, c, ldv(xt.dtype, x.base + o * x.esz));
					}
		}
		return 0;
	}

	int run() {
		for (size_t i = 0; i < g.nodes.size(); i++) {
			const Node &n = g.nodes[i];
			int s = 0;
			switch (n.op->kind) {
			case CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR: s = pointwise(n); break;
			case CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR: s = reduction(n); break;
			case CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR: s = matmul(n); break;
			case CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR: s = reshape(n); break;
			}
			if (s) return s;
			// Free virtual tensors nothing reads any more.
			for (size_t t = 0; t < rt.size(); t++)
				if (rt[t].priv && !rt[t].store.empty() && g.last_use[t] <= (int)i && (g.last_use[t] >= 0 || g.producer[t] == (int)i)) {
					std::vector<unsigned char>().swap(rt[t].store);
					rt[t].base = nullptr;
				}
		}
		return 0;
	}
};

// ---------------------------------------------------------------- get

int put_count(i64 *count, i64 n) {
	if (count) *count = n;
	return 0;
}

} // namespace

extern "C" {

size_t cudnnGetVersion(void) {
	EmuGuard guard;
	const char *v = getenv("DISTILL_EMU_CUDNN_VERSION");
	if (v && *v) return (size_t)strtoull(v, nullptr, 10);
	return 91900;
}

const char *cudnnGetErrorString(int status) { return status_name(status); }

void cudnnGetLastErrorString(char *msg, size_t max) {
	EmuGuard guard;
	if (!msg || max == 0) return;
	snprintf(msg, max, "%s", g_last.c_str());
}

int cudnnCreate(void **handle) {
	EmuGuard guard;
	if (!handle) return fail(CUDNN_STATUS_BAD_PARAM_NULL_POINTER, "cudnnCreate: handle is NULL");
	Handle *h = new Handle;
	g_handles.insert(h);
	*handle = h;
	return 0;
}

int cudnnDestroy(void *handle) {
	EmuGuard guard;
	if (!g_handles.erase((Handle *)handle)) return fail(CUDNN_STATUS_BAD_PARAM, strf("cudnnDestroy: %p is not a handle from cudnnCreate", handle));
	delete (Handle *)handle;
	return 0;
}

int cudnnSetStream(void *handle, void *stream) {
	EmuGuard guard;
	if (!g_handles.count((Handle *)handle)) return fail(CUDNN_STATUS_BAD_PARAM, strf("cudnnSetStream: %p is not a handle from cudnnCreate", handle));
	((Handle *)handle)->stream = stream;
	return 0;
}

int cudnnBackendCreateDescriptor(int type, void **desc) {
	EmuGuard guard;
	if (!desc) return fail(CUDNN_STATUS_BAD_PARAM_NULL_POINTER, "cudnnBackendCreateDescriptor: descriptor is NULL");
	if (!desc_name(type))
		return fail(CUDNN_STATUS_NOT_SUPPORTED, strf("cudnnBackendCreateDescriptor: descriptor type %d is not emulated", type));
	Desc *d = new Desc;
	d->type = type;
	g_descs.insert(d);
	*desc = d;
	return 0;
}

int cudnnBackendDestroyDescriptor(void *desc) {
	EmuGuard guard;
	Desc *d = live(desc);
	if (!d) return fail(CUDNN_STATUS_BAD_PARAM, strf("cudnnBackendDestroyDescriptor: %p is not a live descriptor", desc));
	g_descs.erase(d);
	delete d;
	return 0;
}

int cudnnBackendSetAttribute(void *desc, int name, int type, int64_t count, const void *elems) {
	EmuGuard guard;
	Desc *d = live(desc);
	if (!d) return fail(CUDNN_STATUS_BAD_PARAM, strf("cudnnBackendSetAttribute(%s): %p is not a live descriptor", attr_label(name).c_str(), desc));
	std::string w = "cudnnBackendSetAttribute(" + desc_label(d->type) + ", " + attr_label(name) + ")";
	const Spec *s = find_spec(d->type, name);
	if (!s) return fail(CUDNN_STATUS_BAD_PARAM, strf("%s: not an attribute of a %s that the emulator knows", w.c_str(), desc_label(d->type).c_str()));
	if (!s->settable) return fail(CUDNN_STATUS_BAD_PARAM, w + ": the attribute can only be read");
	if (d->finalized) return fail(CUDNN_STATUS_BAD_PARAM, w + ": the descriptor is already finalized");
	if (type != s->type && type != s->alt)
		return fail(CUDNN_STATUS_BAD_PARAM, strf("%s: the attribute takes %s, not %s", w.c_str(), type_name(s->type), type_name(type)));
	if (count < 0 || (s->scalar && count != 1))
		return fail(CUDNN_STATUS_BAD_PARAM, strf("%s: %lld elements%s", w.c_str(), (long long)count, s->scalar ? "; the attribute takes one" : ""));
	if (count > 0 && !elems) return fail(CUDNN_STATUS_BAD_PARAM_NULL_POINTER, w + ": arrayOfElements is NULL");
	Attr a;
	a.type = type;
	a.count = count;
	a.bytes.assign((const unsigned char *)elems, (const unsigned char *)elems + count * type_size(type));
	d->attrs[name] = a;
	return 0;
}

int cudnnBackendFinalize(void *desc) {
	EmuGuard guard;
	Desc *d = live(desc);
	if (!d) return fail(CUDNN_STATUS_BAD_PARAM, strf("cudnnBackendFinalize: %p is not a live descriptor", desc));
	if (d->finalized) return 0;
	int s;
	switch (d->type) {
	case CUDNN_BACKEND_TENSOR_DESCRIPTOR: s = fin_tensor(d); break;
	case CUDNN_BACKEND_POINTWISE_DESCRIPTOR: s = fin_pointwise_desc(d); break;
	case CUDNN_BACKEND_MATMUL_DESCRIPTOR: s = fin_matmul_desc(d); break;
	case CUDNN_BACKEND_REDUCTION_DESCRIPTOR: s = fin_reduction_desc(d); break;
	case CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR: s = fin_op_pointwise(d); break;
	case CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR: s = fin_op_matmul(d); break;
	case CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR: s = fin_op_reduction(d); break;
	case CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR: s = fin_op_reshape(d); break;
	case CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR: s = fin_graph(d); break;
	case CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR: s = fin_heur(d); break;
	case CUDNN_BACKEND_ENGINE_DESCRIPTOR: s = fin_engine(d); break;
	case CUDNN_BACKEND_ENGINECFG_DESCRIPTOR: s = fin_cfg(d); break;
	case CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR: s = fin_plan(d); break;
	case CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR: s = fin_pack(d); break;
	default: s = fail(CUDNN_STATUS_NOT_SUPPORTED, where(d) + ": the emulator does not finalize this descriptor type (knob choices are not emulated)");
	}
	if (s == 0) d->finalized = true;
	return s;
}

int cudnnBackendGetAttribute(void *desc, int name, int type, int64_t requested, int64_t *count, void *elems) {
	EmuGuard guard;
	Desc *d = live(desc);
	if (!d) return fail(CUDNN_STATUS_BAD_PARAM, strf("cudnnBackendGetAttribute(%s): %p is not a live descriptor", attr_label(name).c_str(), desc));
	std::string w = "cudnnBackendGetAttribute(" + desc_label(d->type) + ", " + attr_label(name) + ")";
	const Spec *s = find_spec(d->type, name);
	if (!s) return fail(CUDNN_STATUS_BAD_PARAM, strf("%s: not an attribute of a %s that the emulator knows", w.c_str(), desc_label(d->type).c_str()));
	if (type != s->type && type != s->alt)
		return fail(CUDNN_STATUS_BAD_PARAM, strf("%s: the attribute is %s, not %s", w.c_str(), type_name(s->type), type_name(type)));
	if (requested < 0) return fail(CUDNN_STATUS_BAD_PARAM, strf("%s: requestedElementCount %lld", w.c_str(), (long long)requested));
	if (requested > 0 && !elems) return fail(CUDNN_STATUS_BAD_PARAM_NULL_POINTER, w + ": arrayOfElements is NULL");
	auto need_final = [&]() {
		return d->finalized ? 0 : fail(CUDNN_STATUS_BAD_PARAM, w + ": the descriptor is not finalized");
	};
	auto scalar_i64 = [&](i64 v) {
		if (requested > 0) memcpy(elems, &v, 8);
		return put_count(count, 1);
	};
	switch (name) {
	case CUDNN_ATTR_ENGINEHEUR_RESULTS: {
		if (int r = need_final()) return r;
		i64 n = refused(*d->graph) ? 0 : kEngines;
		if (requested == 0) return put_count(count, n);
		i64 m = std::min(requested, n);
		for (i64 i = 0; i < m; i++) {
			Desc *c = live(((void **)elems)[i]);
			if (!c || c->type != CUDNN_BACKEND_ENGINECFG_DESCRIPTOR)
				return fail(CUDNN_STATUS_BAD_PARAM, strf("%s: element %lld (%p) is not an ENGINECFG_DESCRIPTOR from cudnnBackendCreateDescriptor",
				                                         w.c_str(), (long long)i, ((void **)elems)[i]));
			c->engine = make_engine(d->graph, i);
			c->finalized = true;
		}
		return put_count(count, m);
	}
	case CUDNN_ATTR_ENGINECFG_ENGINE: {
		if (int r = need_final()) return r;
		if (requested == 0) return put_count(count, 1);
		Desc *e = live(((void **)elems)[0]);
		if (!e || e->type != CUDNN_BACKEND_ENGINE_DESCRIPTOR)
			return fail(CUDNN_STATUS_BAD_PARAM, strf("%s: %p is not an ENGINE_DESCRIPTOR from cudnnBackendCreateDescriptor", w.c_str(), ((void **)elems)[0]));
		e->engine = d->engine;
		e->finalized = true;
		return put_count(count, 1);
	}
	case CUDNN_ATTR_ENGINECFG_WORKSPACE_SIZE:
	case CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE:
		if (int r = need_final()) return r;
		return scalar_i64(d->engine->ws);
	case CUDNN_ATTR_ENGINE_GLOBAL_INDEX:
		if (int r = need_final()) return r;
		return scalar_i64(d->engine->index);
	case CUDNN_ATTR_ENGINE_NUMERICAL_NOTE:
	case CUDNN_ATTR_ENGINE_BEHAVIOR_NOTE: {
		if (int r = need_final()) return r;
		std::vector<int> notes;
		if (name == CUDNN_ATTR_ENGINE_NUMERICAL_NOTE) notes = d->engine->notes;
		i64 n = (i64)notes.size();
		if (requested == 0) return put_count(count, n);
		i64 m = std::min(requested, n);
		memcpy(elems, notes.data(), (size_t)m * 4);
		return put_count(count, m);
	}
	}
	const Attr *a = attr(d, name);
	if (!a) return fail(CUDNN_STATUS_BAD_PARAM, w + ": the attribute is not set");
	if (a->type != type) return fail(CUDNN_STATUS_BAD_PARAM, strf("%s: the attribute was set as %s, not %s", w.c_str(), type_name(a->type), type_name(type)));
	if (requested == 0) return put_count(count, a->count);
	i64 m = std::min(requested, a->count);
	memcpy(elems, a->bytes.data(), (size_t)m * type_size(type));
	return put_count(count, m);
}

int cudnnBackendExecute(void *handle, void *plan, void *variantPack) {
	EmuGuard guard;
	if (!handle) return fail(CUDNN_STATUS_BAD_PARAM_NULL_POINTER, "cudnnBackendExecute: handle is NULL");
	if (!g_handles.count((Handle *)handle)) return fail(CUDNN_STATUS_BAD_PARAM, strf("cudnnBackendExecute: %p is not a handle from cudnnCreate", handle));
	Desc *p = live(plan), *v = live(variantPack);
	if (!p || p->type != CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR || !p->finalized)
		return fail(CUDNN_STATUS_BAD_PARAM, strf("cudnnBackendExecute: %p is not a finalized EXECUTION_PLAN_DESCRIPTOR", plan));
	if (!v || v->type != CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR || !v->finalized)
		return fail(CUDNN_STATUS_BAD_PARAM, strf("cudnnBackendExecute: %p is not a finalized VARIANT_PACK_DESCRIPTOR", variantPack));
	if (p->handle && p->handle != handle)
		return fail(CUDNN_STATUS_BAD_PARAM, strf("cudnnBackendExecute: the plan was made for handle %p, not %p", p->handle, handle));
	const Engine &e = *p->engine;
	Exec x(*e.graph);
	if (int s = x.bind(v, e.ws)) return s;
	// Stream order (emu.cpp): every device tensor and the workspace, as
	// written (which are the graph's outputs is not worked out here).
	{
		char why[600];
		void *st = ((Handle *)handle)->stream;
		for (void *q : v->ptrs)
			if (q && !emu_stream_access(st, (u64)q, true, "cudnnBackendExecute", why, sizeof why)) return fail(CUDNN_STATUS_EXECUTION_FAILED, why);
		if (v->ws && !emu_stream_access(st, (u64)v->ws, true, "cudnnBackendExecute (workspace)", why, sizeof why))
			return fail(CUDNN_STATUS_EXECUTION_FAILED, why);
	}
	if (int s = x.run()) return s;
	// The engine's scratch: whatever the caller kept there is gone.
	if (e.ws > 0) memset(v->ws, 0xff, (size_t)e.ws);
	return 0;
}

} // extern "C"
