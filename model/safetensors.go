package model

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"sort"
	"syscall"
	"unsafe"

	"distill/compute"
	"distill/internal/atomicfile"
	"distill/internal/errkind"
)

// Safetensors layout (huggingface/safetensors):
//
//	u64 little-endian N | N bytes JSON header | data
//
// The header maps tensor names to {"dtype","shape","data_offsets":[b,e]}
// with offsets relative to the start of data, plus an optional
// "__metadata__" map of strings. A sharded checkpoint has
// model.safetensors.index.json: {"weight_map": {name: file}}.

// ErrSafetensors marks a malformed or inconsistent safetensors file.
var ErrSafetensors = errors.New("model: safetensors")

// ErrNonFinite marks a stored tensor holding NaN or infinite values.
var ErrNonFinite = fmt.Errorf("%w: non-finite weights", ErrSafetensors)

// maxHeader bounds the JSON header; real ones are well under 10 MB.
const maxHeader = 100 << 20

var dtypeSize = map[string]int{"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}

// TensorInfo describes one stored tensor.
type TensorInfo struct {
	Name  string
	DType string // "BF16", "F16", "F32", ...
	Shape []int
	File  string
}

// Numel is the element count.
func (t TensorInfo) Numel() int {
	n := 1
	for _, d := range t.Shape {
		n *= d
	}
	return n
}

type stFile struct {
	path string
	data []byte // the whole mmap'd file
	base int    // offset of the data section
}

type stTensor struct {
	info TensorInfo
	f    *stFile
	b, e int // absolute byte range in f.data
}

// Weights is a read-only, memory-mapped set of safetensors files.
type Weights struct {
	files   []*stFile
	tensors map[string]*stTensor
}

// OpenFile memory-maps one safetensors file of any name (a PEFT
// adapter_model.safetensors, an optimizer state).
func OpenFile(path string) (*Weights, error) {
	f, infos, err := openSafetensors(path)
	if err != nil {
		return nil, err
	}
	w := &Weights{files: []*stFile{f}, tensors: map[string]*stTensor{}}
	for _, t := range infos {
		w.tensors[t.info.Name] = t
	}
	return w, nil
}

// ShardedTrainingFormat is the "format" of a sharded training
// checkpoint's manifest.json (package trainer writes them).
const ShardedTrainingFormat = "distill-sharded-checkpoint"

// isShardedTraining reports whether dir holds a sharded training
// checkpoint (package trainer's manifest.json), whose safetensors files
// are pieces of tensors, not tensors.
func isShardedTraining(dir string) bool {
	b, err := os.ReadFile(filepath.Join(dir, "manifest.json"))
	if err != nil {
		return false
	}
	var m struct {
		Format string `json:"format"`
	}
	return json.Unmarshal(b, &m) == nil && m.Format == ShardedTrainingFormat
}

// OpenWeights memory-maps the checkpoint in dir: model.safetensors, or the
// shards named by model.safetensors.index.json, or (failing both) every
// *.safetensors file in dir.
func OpenWeights(dir string) (*Weights, error) {
	w := &Weights{tensors: map[string]*stTensor{}}
	idxPath := filepath.Join(dir, "model.safetensors.index.json")
	var files []string
	var weightMap map[string]string
	if b, err := os.ReadFile(idxPath); err == nil {
		var idx struct {
			WeightMap map[string]string `json:"weight_map"`
		}
		if err := json.Unmarshal(b, &idx); err != nil {
			return nil, errkind.Errorf(ErrSafetensors, "%s: %v", idxPath, err)
		}
		if len(idx.WeightMap) == 0 {
			return nil, errkind.Errorf(ErrSafetensors, "%s: empty weight_map", idxPath)
		}
		weightMap = idx.WeightMap
		seen := map[string]bool{}
		for _, f := range idx.WeightMap {
			if !seen[f] {
				seen[f] = true
				files = append(files, f)
			}
		}
		sort.Strings(files)
	} else if _, err := os.Stat(filepath.Join(dir, "model.safetensors")); err == nil {
		files = []string{"model.safetensors"}
	} else {
		if isShardedTraining(dir) {
			return nil, errkind.Errorf(ErrSafetensors, "%s is a sharded training checkpoint (each rank's part of a data-parallel run's weights and optimizer state, with a manifest.json), not an HF checkpoint: make one with `student export --checkpoint %s --out DIR`", dir, dir)
		}
		m, _ := filepath.Glob(filepath.Join(dir, "*.safetensors"))
		for _, p := range m {
			files = append(files, filepath.Base(p))
		}
		if len(files) == 0 {
			return nil, errkind.Errorf(ErrSafetensors, "no model.safetensors, model.safetensors.index.json or *.safetensors in %s", dir)
		}
	}
	for _, name := range files {
		f, infos, err := openSafetensors(filepath.Join(dir, name))
		if err != nil {
			w.Close()
			return nil, err
		}
		w.files = append(w.files, f)
		for _, t := range infos {
			if _, dup := w.tensors[t.info.Name]; dup {
				w.Close()
				return nil, errkind.Errorf(ErrSafetensors, "tensor %s appears in two files (second: %s)", t.info.Name, f.path)
			}
			if weightMap != nil && weightMap[t.info.Name] != name {
				w.Close()
				return nil, errkind.Errorf(ErrSafetensors, "tensor %s is in %s but the index maps it to %q", t.info.Name, name, weightMap[t.info.Name])
			}
			w.tensors[t.info.Name] = t
		}
	}
	for name, file := range weightMap {
		if _, ok := w.tensors[name]; !ok {
			w.Close()
			return nil, errkind.Errorf(ErrSafetensors, "index maps tensor %s to %s, which does not hold it", name, file)
		}
	}
	return w, nil
}

func openSafetensors(path string) (*stFile, []*stTensor, error) {
	fail := func(format string, a ...any) error {
		return errkind.Errorf(ErrSafetensors, "%s: %s", path, fmt.Sprintf(format, a...))
	}
	fd, err := os.Open(path)
	if err != nil {
		return nil, nil, errkind.Errorf(ErrSafetensors, "%v", err)
	}
	defer fd.Close()
	st, err := fd.Stat()
	if err != nil {
		return nil, nil, errkind.Errorf(ErrSafetensors, "%v", err)
	}
	size := st.Size()
	if size < 8 {
		return nil, nil, fail("file is %d bytes, too short for a header (truncated?)", size)
	}
	data, err := syscall.Mmap(int(fd.Fd()), 0, int(size), syscall.PROT_READ, syscall.MAP_SHARED)
	if err != nil {
		return nil, nil, fail("mmap: %v", err)
	}
	f := &stFile{path: path, data: data}
	ok := false
	defer func() {
		if !ok {
			syscall.Munmap(data)
		}
	}()
	n := binary.LittleEndian.Uint64(data[:8])
	if n > maxHeader || int64(n) > size-8 {
		return nil, nil, fail("header length %d overruns the %d-byte file (truncated or not safetensors)", n, size)
	}
	f.base = 8 + int(n)
	var hdr map[string]json.RawMessage
	if err := json.Unmarshal(data[8:f.base], &hdr); err != nil {
		return nil, nil, fail("header is not valid JSON: %v", err)
	}
	dataLen := int(size) - f.base
	var ts []*stTensor
	for name, raw := range hdr {
		if name == "__metadata__" {
			continue
		}
		var e struct {
			DType   string `json:"dtype"`
			Shape   []int  `json:"shape"`
			Offsets []int  `json:"data_offsets"`
		}
		if err := json.Unmarshal(raw, &e); err != nil {
			return nil, nil, fail("tensor %s: bad header entry: %v", name, err)
		}
		es, known := dtypeSize[e.DType]
		if !known {
			return nil, nil, fail("tensor %s: unknown dtype %q", name, e.DType)
		}
		if len(e.Offsets) != 2 {
			return nil, nil, fail("tensor %s: data_offsets must have 2 entries", name)
		}
		numel := 1
		for _, d := range e.Shape {
			if d < 0 {
				return nil, nil, fail("tensor %s: negative dimension in shape %v", name, e.Shape)
			}
			numel *= d
		}
		b, en := e.Offsets[0], e.Offsets[1]
		if b < 0 || en < b || en > dataLen {
			return nil, nil, fail("tensor %s: data_offsets [%d,%d) overrun the %d data bytes (truncated file?)", name, b, en, dataLen)
		}
		if en-b != numel*es {
			return nil, nil, fail("tensor %s: %s%v needs %d bytes, data_offsets give %d", name, e.DType, e.Shape, numel*es, en-b)
		}
		ts = append(ts, &stTensor{info: TensorInfo{Name: name, DType: e.DType, Shape: e.Shape, File: path}, f: f, b: f.base + b, e: f.base + en})
	}
	sort.Slice(ts, func(i, j int) bool { return ts[i].b < ts[j].b })
	for i := 1; i < len(ts); i++ {
		if ts[i].b < ts[i-1].e {
			return nil, nil, fail("tensors %s and %s overlap", ts[i-1].info.Name, ts[i].info.Name)
		}
	}
	ok = true
	return f, ts, nil
}

// Close unmaps the files; tensors read before stay valid (they are copies).
func (w *Weights) Close() error {
	for _, f := range w.files {
		if f.data != nil {
			syscall.Munmap(f.data)
			f.data = nil
		}
	}
	return nil
}

// Names lists the stored tensor names, sorted.
func (w *Weights) Names() []string {
	out := make([]string, 0, len(w.tensors))
	for n := range w.tensors {
		out = append(out, n)
	}
	sort.Strings(out)
	return out
}

// Info describes tensor name.
func (w *Weights) Info(name string) (TensorInfo, bool) {
	t, ok := w.tensors[name]
	if !ok {
		return TensorInfo{}, false
	}
	return t.info, true
}

// Raw returns the stored bytes of name, aliasing the mapping (valid until
// Close).
func (w *Weights) Raw(name string) ([]byte, TensorInfo, error) {
	t, ok := w.tensors[name]
	if !ok {
		return nil, TensorInfo{}, errkind.Errorf(ErrSafetensors, "missing tensor %s", name)
	}
	return t.f.data[t.b:t.e], t.info, nil
}

// F32 returns a float32 copy of a BF16, F16 or F32 tensor. A NaN or
// infinite value is an error naming the tensor: no loader computes with
// a corrupt or diverged checkpoint.
func (w *Weights) F32(name string) ([]float32, error) {
	raw, info, err := w.Raw(name)
	if err != nil {
		return nil, err
	}
	out := make([]float32, info.Numel())
	bad := 0 // non-finite values seen
	switch info.DType {
	case "F32":
		for i := range out {
			u := binary.LittleEndian.Uint32(raw[4*i:])
			if u&0x7f800000 == 0x7f800000 {
				bad++
			}
			out[i] = math.Float32frombits(u)
		}
	case "BF16":
		for i := range out {
			u := binary.LittleEndian.Uint16(raw[2*i:])
			if u&0x7f80 == 0x7f80 {
				bad++
			}
			out[i] = compute.BF16ToF32(u)
		}
	case "F16":
		for i := range out {
			u := binary.LittleEndian.Uint16(raw[2*i:])
			if u&0x7c00 == 0x7c00 {
				bad++
			}
			out[i] = compute.F16ToF32(u)
		}
	default:
		return nil, errkind.Errorf(ErrSafetensors, "tensor %s has dtype %s; want BF16, F16 or F32", name, info.DType)
	}
	if bad > 0 {
		return nil, nonFinite(info, out, bad)
	}
	return out, nil
}

// BF16 returns the tensor as bfloat16 bits: the stored bits for BF16, and
// F16/F32 rounded to nearest even. Non-finite values are an error, as in F32.
func (w *Weights) BF16(name string) ([]uint16, error) {
	raw, info, err := w.Raw(name)
	if err != nil {
		return nil, err
	}
	if info.DType == "BF16" {
		out := make([]uint16, info.Numel())
		bad := 0
		for i := range out {
			u := binary.LittleEndian.Uint16(raw[2*i:])
			if u&0x7f80 == 0x7f80 {
				bad++
			}
			out[i] = u
		}
		if bad > 0 {
			f := make([]float32, len(out))
			for i, u := range out {
				f[i] = compute.BF16ToF32(u)
			}
			return nil, nonFinite(info, f, bad)
		}
		return out, nil
	}
	f, err := w.F32(name)
	if err != nil {
		return nil, err
	}
	out := make([]uint16, len(f))
	compute.NarrowBF16(out, f)
	return out, nil
}

// nonFinite is the error for a tensor holding NaN or infinite values
// (v is the tensor as float32): it names the tensor, its file and the
// first bad element.
func nonFinite(info TensorInfo, v []float32, bad int) error {
	first := 0
	for first < len(v) && !math.IsNaN(float64(v[first])) && !math.IsInf(float64(v[first]), 0) {
		first++
	}
	return errkind.Errorf(ErrNonFinite, "tensor %s (%s) holds %d non-finite values of %d (the first, element %d, is %v): the checkpoint is corrupt or its training diverged; use an earlier checkpoint",
		info.Name, info.File, bad, len(v), first, v[first])
}

// Check verifies that the stored tensors are exactly those of cfg, with the
// right shapes and a float dtype: a missing, extra or mis-shaped tensor is
// an error naming it.
func (w *Weights) Check(cfg *Config) error {
	want := map[string]bool{}
	var errs []error
	for _, s := range cfg.Tensors() {
		want[s.Name] = true
		info, ok := w.Info(s.Name)
		if !ok {
			errs = append(errs, fmt.Errorf("missing tensor %s %v", s.Name, s.Shape))
			continue
		}
		if !equalShape(info.Shape, s.Shape) {
			errs = append(errs, fmt.Errorf("tensor %s has shape %v, config.json implies %v", s.Name, info.Shape, s.Shape))
		}
		if info.DType != "BF16" && info.DType != "F16" && info.DType != "F32" {
			errs = append(errs, fmt.Errorf("tensor %s has dtype %s; want BF16, F16 or F32", s.Name, info.DType))
		}
	}
	for _, n := range w.Names() {
		if want[n] {
			continue
		}
		if n == "lm_head.weight" && cfg.TieEmbeddings {
			// Some exporters store the tied head anyway; it must equal the
			// embedding, which we use.
			continue
		}
		errs = append(errs, fmt.Errorf("unexpected tensor %s (not in a %s checkpoint of this config)", n, cfg.Arch))
	}
	if len(errs) > 0 {
		if len(errs) > 8 {
			errs = append(errs[:8], fmt.Errorf("... and %d more", len(errs)-8))
		}
		return errkind.Errorf(ErrSafetensors, "checkpoint does not match config.json: %w", errors.Join(errs...))
	}
	return nil
}

func equalShape(a, b []int) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// Tensor is a tensor to write.
type Tensor struct {
	Name  string
	DType string // "BF16", "F32", "U8", "F8_E4M3", ...
	Shape []int
	Data  []byte // little-endian
}

// F32Tensor packs float32 values as an F32 tensor.
func F32Tensor(name string, shape []int, v []float32) Tensor {
	b := make([]byte, 4*len(v))
	for i, f := range v {
		binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(f))
	}
	return Tensor{Name: name, DType: "F32", Shape: shape, Data: b}
}

// BF16Tensor rounds float32 values to BF16 (nearest even).
func BF16Tensor(name string, shape []int, v []float32) Tensor {
	return Tensor{Name: name, DType: "BF16", Shape: shape, Data: BF16Bytes(nil, v)}
}

// WriteSafetensors writes ts to path atomically (internal/atomicfile: temp
// file, fsync, rename, directory fsync), in the given order, with 8-byte
// aligned data as the format recommends.
func WriteSafetensors(path string, ts []Tensor, meta map[string]string) error {
	st := make([]StreamTensor, len(ts))
	for i, t := range ts {
		st[i] = StreamTensor{Name: t.Name, DType: t.DType, Shape: t.Shape, Bytes: func() ([]byte, error) { return t.Data, nil }}
		if es, ok := dtypeSize[t.DType]; ok && numel(t.Shape)*es != len(t.Data) {
			return errkind.Errorf(ErrSafetensors, "tensor %s: %s%v needs %d bytes, got %d", t.Name, t.DType, t.Shape, numel(t.Shape)*es, len(t.Data))
		}
	}
	return WriteSafetensorsStream(path, st, meta)
}

// StreamTensor is a tensor to write whose bytes are made only when its
// turn comes (WriteSafetensorsStream): a writer of a large checkpoint
// holds one tensor in memory, not all of them.
type StreamTensor struct {
	Name  string
	DType string
	Shape []int
	// Bytes returns the tensor's little-endian data; the slice is not
	// kept after it is written (a caller may reuse it).
	Bytes func() ([]byte, error)
}

// WriteSafetensorsStream is WriteSafetensors with each tensor's data
// asked for as it is written: the header (names, dtypes, shapes, offsets)
// comes from the shapes alone. A tensor whose data has another length
// than its shape's is an error, and nothing is written at path.
func WriteSafetensorsStream(path string, ts []StreamTensor, meta map[string]string) error {
	hdr := map[string]any{}
	if len(meta) > 0 {
		hdr["__metadata__"] = meta
	}
	off := 0
	sizes := make([]int, len(ts))
	for i, t := range ts {
		es, ok := dtypeSize[t.DType]
		if !ok {
			return errkind.Errorf(ErrSafetensors, "tensor %s: unknown dtype %q", t.Name, t.DType)
		}
		if _, dup := hdr[t.Name]; dup {
			return errkind.Errorf(ErrSafetensors, "tensor %s given twice", t.Name)
		}
		shape := t.Shape
		if shape == nil {
			shape = []int{}
		}
		sizes[i] = numel(shape) * es
		hdr[t.Name] = map[string]any{"dtype": t.DType, "shape": shape, "data_offsets": []int{off, off + sizes[i]}}
		off += sizes[i]
	}
	hb, err := json.Marshal(hdr)
	if err != nil {
		return err
	}
	for len(hb)%8 != 0 {
		hb = append(hb, ' ')
	}
	var lenb [8]byte
	binary.LittleEndian.PutUint64(lenb[:], uint64(len(hb)))
	err = atomicfile.Write(path, 0o644, func(w io.Writer) error {
		if _, err := w.Write(lenb[:]); err != nil {
			return err
		}
		if _, err := w.Write(hb); err != nil {
			return err
		}
		for i, t := range ts {
			b, err := t.Bytes()
			if err != nil {
				return fmt.Errorf("tensor %s: %w", t.Name, err)
			}
			if len(b) != sizes[i] {
				return errkind.Errorf(ErrSafetensors, "tensor %s: %s%v needs %d bytes, got %d", t.Name, t.DType, t.Shape, sizes[i], len(b))
			}
			if _, err := w.Write(b); err != nil {
				return err
			}
		}
		return nil
	})
	return err // it names path
}

func numel(shape []int) int {
	n := 1
	for _, d := range shape {
		n *= d
	}
	return n
}

// BF16Bytes rounds float32 values to BF16 (nearest even) little-endian
// into buf (grown as needed) and returns it.
func BF16Bytes(buf []byte, v []float32) []byte {
	if cap(buf) < 2*len(v) {
		buf = make([]byte, 2*len(v))
	}
	buf = buf[:2*len(v)]
	for i, f := range v {
		binary.LittleEndian.PutUint16(buf[2*i:], compute.F32ToBF16(f))
	}
	return buf
}

// F32Bytes packs float32 values little-endian into buf (grown as
// needed) and returns it: a StreamTensor's data without a new slice per
// tensor.
func F32Bytes(buf []byte, v []float32) []byte {
	if cap(buf) < 4*len(v) {
		buf = make([]byte, 4*len(v))
	}
	buf = buf[:4*len(v)]
	for i, f := range v {
		binary.LittleEndian.PutUint32(buf[4*i:], math.Float32bits(f))
	}
	return buf
}

// float32Bytes views v as bytes (little-endian hosts only, which is all we
// build for: amd64 and arm64).
func float32Bytes(v []float32) []byte {
	if len(v) == 0 {
		return nil
	}
	return unsafe.Slice((*byte)(unsafe.Pointer(&v[0])), 4*len(v))
}
