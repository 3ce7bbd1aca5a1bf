package model

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"math/rand/v2"
	"os"
	"os/signal"
	"path/filepath"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"

	"distill/internal/atomicfile"
	"distill/internal/errkind"
	"distill/internal/namelist"
)

// ErrNotEmpty marks an output directory that already holds files.
var ErrNotEmpty = errors.New("model: output directory is not empty")

// WriteDir makes dir hold exactly the files write puts into the empty
// directory it is given, never a mix of old and new files: write fills a
// temporary directory next to dir, every file in it is synced, and it is
// renamed to dir. A dir that exists and is not empty is refused
// (ErrNotEmpty, naming some of its files) unless force; one that is not a
// model's (a cache, a run directory, any directory holding directories or
// dataset files) is refused either way (ErrNotReplaceable); with force, the
// old dir is renamed aside, the new one into place, and the old one
// removed. A crash leaves dir whole (old or new) or, in the instant
// between the two renames of a forced replace, absent with both versions
// beside it as .old-* and .tmp-*. A failed write leaves dir untouched.
// A dir that cannot be replaced (a mount point) is refused before write
// runs (ErrNotReplaceable), as is one beside which nothing can be written.
// SIGINT or SIGTERM during the write removes the temporary directory and
// ends the process by that signal, as it would have ended (guardTmp); a
// crash or SIGKILL during the write leaves it beside dir as .tmp-*.
func WriteDir(dir string, force bool, write func(tmp string) error) error {
	dir = filepath.Clean(dir)
	exists, err := checkOut(dir, force)
	if err != nil {
		return err
	}
	parent, base := filepath.Split(dir)
	if parent == "" {
		parent = "."
	}
	if err := os.MkdirAll(parent, 0o755); err != nil {
		return cannotWrite(dir, err)
	}
	tmp := filepath.Join(parent, fmt.Sprintf(".tmp-%s-%d", base, os.Getpid()))
	os.RemoveAll(tmp)
	if err := os.Mkdir(tmp, 0o755); err != nil {
		return cannotWrite(dir, err)
	}
	g := guardTmp(tmp)
	defer g.stop()
	err = func() error {
		if err := write(tmp); err != nil {
			return err
		}
		if err := syncTree(tmp); err != nil {
			return err
		}
		g.mu.Lock() // no signal lands between the renames
		defer g.mu.Unlock()
		if exists {
			old := filepath.Join(parent, fmt.Sprintf(".old-%s-%d", base, os.Getpid()))
			os.RemoveAll(old)
			if err := os.Rename(dir, old); err != nil {
				return err
			}
			if err := os.Rename(tmp, dir); err != nil {
				os.Rename(old, dir)
				return err
			}
			os.RemoveAll(old)
		} else {
			// os.Rename never replaces a directory, even an empty one.
			if err := os.Remove(dir); err != nil && !errors.Is(err, fs.ErrNotExist) {
				return fmt.Errorf("%w: the empty directory cannot be replaced (a mount point cannot): choose a directory inside it, e.g. %s", err, filepath.Join(dir, "model"))
			}
			if err := os.Rename(tmp, dir); err != nil {
				return err
			}
		}
		return atomicfile.Sync(parent)
	}()
	if err != nil {
		os.RemoveAll(tmp)
		return fmt.Errorf("writing %s: %w", dir, err)
	}
	return nil
}

// tmpGuard is WriteDir's handling of SIGINT and SIGTERM: an export or
// init interrupted while it wrote (Ctrl-C, a scheduler's SIGTERM) left
// its hidden .tmp-OUT-PID beside --out, as large as the model, which no
// later run removes (another pid names its own). The first such signal
// removes the temporary directory, if the renames into place have not
// moved it (they run under mu, so a signal never lands between them),
// then stops the handling and sends the signal again, to its own thread:
// the process ends by it as it would have without the handler (the
// shell's 128+N), or a handler of the caller's own gets it. Signals the
// process ignores (a background job's SIGINT) stay ignored.
type tmpGuard struct {
	mu   sync.Mutex
	ch   chan os.Signal
	done chan struct{}
	// ended is closed when the handling goroutine returns: WriteDir,
	// which the write's failure (its directory removed) may end first,
	// waits for the removal and the signal.
	ended chan struct{}
}

func guardTmp(tmp string) *tmpGuard {
	g := &tmpGuard{ch: make(chan os.Signal, 1), done: make(chan struct{}), ended: make(chan struct{})}
	var sigs []os.Signal
	for _, s := range []os.Signal{os.Interrupt, syscall.SIGTERM} {
		if !signal.Ignored(s) {
			sigs = append(sigs, s)
		}
	}
	if len(sigs) == 0 {
		close(g.ended)
		return g
	}
	signal.Notify(g.ch, sigs...)
	go func() {
		defer close(g.ended)
		select {
		case sig := <-g.ch:
			g.mu.Lock()
			// Renamed first: the write may still be creating files in
			// tmp, which RemoveAll would then fail to remove. Once the
			// renames are done, tmp is no more.
			trash := tmp + ".interrupted"
			if os.Rename(tmp, trash) == nil {
				os.RemoveAll(trash)
			} else {
				os.RemoveAll(tmp)
			}
			signal.Stop(g.ch)
			g.mu.Unlock()
			if s, ok := sig.(syscall.Signal); ok {
				// To this thread: it takes the signal before Tgkill
				// returns, so the process ends here, and WriteDir does not
				// return (its write failed with its directory gone) and
				// exit 1 first; with a handler of the caller's, it goes on.
				runtime.LockOSThread()
				syscall.Tgkill(os.Getpid(), syscall.Gettid(), s)
				runtime.UnlockOSThread()
			}
		case <-g.done:
		}
	}()
	return g
}

func (g *tmpGuard) stop() {
	signal.Stop(g.ch)
	close(g.done)
	<-g.ended
}

// ErrNotReplaceable marks an output directory that exists and cannot be
// replaced: WriteDir writes the new directory beside it and renames it
// into its place, which a mount point refuses (EBUSY).
var ErrNotReplaceable = errors.New("model: output directory cannot be replaced")

// CheckOut says, before anything is made or written, whether WriteDir(dir,
// force) can begin and put its directory in dir's place: dir is no file,
// not a non-empty directory without force (ErrNotEmpty), not a mount
// point (ErrNotReplaceable), and a directory can be made beside it. A
// caller with work to do before WriteDir (loading a model to export)
// checks this first.
func CheckOut(dir string, force bool) error {
	dir = filepath.Clean(dir)
	if _, err := checkOut(dir, force); err != nil {
		return err
	}
	// The nearest directory that exists must take the temporary
	// directory (WriteDir makes the missing ones in it): try one.
	p := filepath.Dir(dir)
	for {
		fi, err := os.Stat(p)
		switch {
		case err == nil && !fi.IsDir():
			return cannotWrite(dir, syscall.ENOTDIR) // it names the file
		case err != nil && !errors.Is(err, fs.ErrNotExist):
			return cannotWrite(dir, err)
		}
		if err == nil || filepath.Dir(p) == p {
			break
		}
		p = filepath.Dir(p)
	}
	probe, err := os.MkdirTemp(p, ".probe-")
	if err != nil {
		return cannotWrite(dir, err)
	}
	return os.Remove(probe)
}

// checkOut is what WriteDir checks of dir before it writes anything:
// whether dir exists and holds files (exists), is a file, is not empty
// without force, or is a mount point.
func checkOut(dir string, force bool) (exists bool, err error) {
	switch fi, err := os.Stat(dir); {
	case err == nil && !fi.IsDir():
		return false, fmt.Errorf("%s exists and is not a directory: choose a directory path", dir)
	case err == nil:
		ents, err := os.ReadDir(dir)
		if err != nil {
			return false, err
		}
		exists = len(ents) > 0
		if exists {
			// Before the advice to give --force, which would be wrong.
			if err := checkReplaceable(dir, ents); err != nil {
				return false, err
			}
		}
		if exists && !force {
			files := make([]string, len(ents))
			for i, e := range ents {
				files[i] = e.Name()
			}
			return false, errkind.Errorf(ErrNotEmpty, "%s is not empty (it holds %s): give --force to replace it (its files are all removed), or choose another directory",
				dir, namelist.Head(files, 5))
		}
		if isMountPoint(dir, fi) {
			// It would fail only after the whole write, beside it (on
			// the file system the mount hides).
			return false, errkind.Errorf(ErrNotReplaceable, "%s is a mount point, and the new directory is written beside it and renamed into its place, which a mount point refuses: choose a directory inside it, e.g. %s",
				dir, filepath.Join(dir, "model"))
		}
	case !errors.Is(err, fs.ErrNotExist):
		return false, cannotWrite(dir, err)
	}
	return exists, nil
}

// checkReplaceable refuses, with ErrNotReplaceable, an output directory
// that force must not remove, because it is not a model's: one holding a directory (a teacher
// cache's index/ and chunks/, a training run's checkpoints/; what init
// and export write is files only) or dataset files. --force is for
// replacing an earlier model; `student export --out CACHE --force`
// removed a cache, the hours of teacher compute in it, and exited 0.
func checkReplaceable(dir string, ents []os.DirEntry) error {
	_, what := classifyEntries(ents)
	if what == "" {
		return nil
	}
	alt := filepath.Clean(dir)
	if abs, err := filepath.Abs(alt); err == nil && (alt == "." || alt == "..") {
		alt = abs
	}
	return errkind.Errorf(ErrNotReplaceable, "%s %s: only a model directory is replaced (--force), and this one's data would be lost; nothing was removed: choose a new directory, e.g. %s-model",
		dir, what, alt)
}

// A DirKind is what ClassifyDir finds a directory to be.
type DirKind int

const (
	DirOther DirKind = iota // none of the below: missing, empty, or anything else
	DirCache                // a teacher cache: index/ and chunks/
	DirRun                  // a student train run directory: checkpoints/
	DirModel                // an HF model: model.safetensors, or a config.json naming model_type or architectures
)

// ClassifyDir says what dir is, and says it in words that follow dir's
// name in an error ("is a teacher cache (index/ and chunks/, as cachectl
// fill writes them)"), as WriteDir's refusals do: a teacher cache, then a
// student train run directory, then an HF model directory, else
// DirOther and "". A directory that is more than one (a run trained into
// a model's directory) is the first of these.
func ClassifyDir(dir string) (DirKind, string) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return DirOther, ""
	}
	if k, what := classifyEntries(ents); k != DirOther {
		return k, what
	}
	for _, name := range []string{"config.json", "model.safetensors"} {
		if IsModelFile(filepath.Join(dir, name)) {
			return DirModel, "is an HF model directory (it holds " + name + ")"
		}
	}
	return DirOther, ""
}

// classifyEntries is what a directory holding ents is, of those that are
// not a model's (WriteDir never replaces them): a teacher cache, a run
// directory (DirCache, DirRun), one holding directories or dataset files
// (DirOther with its words), or none of these (DirOther, "").
func classifyEntries(ents []os.DirEntry) (DirKind, string) {
	has := map[string]bool{}
	var sub, data []string
	for _, e := range ents {
		has[e.Name()] = e.IsDir()
		switch {
		case e.IsDir():
			sub = append(sub, e.Name()+"/")
		case dataFile(e.Name()):
			data = append(data, e.Name())
		}
	}
	switch {
	case has["index"] && has["chunks"]:
		return DirCache, "is a teacher cache (index/ and chunks/, as cachectl fill writes them)"
	case has["checkpoints"]:
		return DirRun, "is a student train run directory (checkpoints/)"
	case len(sub) > 0:
		sort.Strings(sub)
		return DirOther, "holds directories (" + strings.Join(sub, ", ") + "), which no model written by student init or export holds"
	case len(data) > 0:
		sort.Strings(data)
		return DirOther, "holds dataset files (" + strings.Join(data, ", ") + ")"
	}
	return DirOther, ""
}

// IsModelFile reports whether path is a model's file: model.safetensors,
// or a config.json that names a model_type or architectures, as an HF
// model's does (a project's config.json does not make its directory a
// model's).
func IsModelFile(path string) bool {
	if filepath.Base(path) != "config.json" {
		_, err := os.Stat(path)
		return err == nil
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return false
	}
	var keys map[string]json.RawMessage
	if json.Unmarshal(b, &keys) != nil {
		return false
	}
	_, mt := keys["model_type"]
	_, arch := keys["architectures"]
	return mt || arch
}

// dataFile reports whether name is a dataset's or a cache chunk's file,
// which no model directory holds.
func dataFile(name string) bool {
	switch strings.ToLower(filepath.Ext(name)) {
	case ".jsonl", ".csv", ".parquet", ".arrow":
		return true
	}
	return false
}

// mountInfo lists the process's mount points (a test's fake file).
var mountInfo = "/proc/self/mountinfo"

// isMountPoint reports whether the directory dir (fi: its stat) is a
// mount point: on another device than its parent, or listed in
// mountInfo (a bind mount of the same file system).
func isMountPoint(dir string, fi fs.FileInfo) bool {
	abs, err := filepath.Abs(dir)
	if err != nil {
		return false
	}
	if r, err := filepath.EvalSymlinks(abs); err == nil {
		abs = r
	}
	if pfi, err := os.Stat(filepath.Dir(abs)); err == nil {
		a, ok1 := fi.Sys().(*syscall.Stat_t)
		b, ok2 := pfi.Sys().(*syscall.Stat_t)
		if ok1 && ok2 && a.Dev != b.Dev {
			return true
		}
	}
	b, err := os.ReadFile(mountInfo)
	if err != nil {
		return false
	}
	for _, line := range strings.Split(string(b), "\n") {
		// ID PARENT MAJOR:MINOR ROOT MOUNTPOINT ..., with spaces, tabs,
		// newlines and backslashes in MOUNTPOINT as octal escapes.
		if f := strings.Fields(line); len(f) >= 5 && unescapeMount(f[4]) == abs {
			return true
		}
	}
	return false
}

// unescapeMount decodes mountinfo's octal escapes (\040 is a space).
func unescapeMount(s string) string {
	if !strings.Contains(s, "\\") {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if n, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(n))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// cannotWrite is the error of a WriteDir that cannot even begin in dir:
// it names dir, and the path at fault in the user's terms (the error
// named the temporary directory beside dir, or only "stat ...: not a
// directory").
func cannotWrite(dir string, err error) error {
	if errors.Is(err, syscall.ENOTDIR) {
		for p := filepath.Dir(dir); p != filepath.Dir(p); p = filepath.Dir(p) {
			if fi, e := os.Stat(p); e == nil && !fi.IsDir() {
				return fmt.Errorf("cannot write %s: %s is a file, not a directory: choose another directory", dir, p)
			}
		}
	}
	var pe *fs.PathError
	if errors.As(err, &pe) {
		// The directory a file or directory could not be created in.
		return fmt.Errorf("cannot write %s: cannot create files in %s (%v): choose a directory you can write", dir, filepath.Dir(pe.Path), pe.Err)
	}
	return fmt.Errorf("cannot write %s: %w", dir, err)
}

// syncTree syncs every file and directory under root.
func syncTree(root string) error {
	return filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.Type()&fs.ModeSymlink != 0 {
			return nil
		}
		return atomicfile.Sync(p)
	})
}

// InitOptions control random initialization.
type InitOptions struct {
	Seed uint64
	// Std of the normal init of matrices (HF initializer_range, 0.02).
	Std float64
	// Perturb draws norm weights as 1+N(0,0.1²) and biases as N(0,Std²)
	// instead of ones and zeros, so tests exercise every parameter.
	Perturb bool
	// DType of the written tensors: "BF16" (default) or "F32".
	DType string
}

// Init returns random tensors for a checkpoint of cfg, as float32 values in
// the order of cfg.Tensors(). Initialization is deterministic in Seed.
func Init(cfg *Config, opt InitOptions) map[string][]float32 {
	if opt.Std == 0 {
		opt.Std = 0.02
	}
	out := map[string][]float32{}
	for i, s := range cfg.Tensors() {
		// One stream per tensor, so adding a tensor does not shift others.
		r := rand.New(rand.NewPCG(opt.Seed, uint64(i)))
		n := 1
		for _, d := range s.Shape {
			n *= d
		}
		v := make([]float32, n)
		switch {
		case s.Norm && opt.Perturb:
			for j := range v {
				v[j] = float32(1 + 0.1*r.NormFloat64())
			}
		case s.Norm:
			for j := range v {
				v[j] = 1
			}
		case s.Bias && !opt.Perturb:
		default:
			for j := range v {
				v[j] = float32(opt.Std * r.NormFloat64())
			}
		}
		out[s.Name] = v
	}
	return out
}

// WriteCheckpoint writes an HF checkpoint directory: config.json and
// model.safetensors holding tensors (every tensor of cfg.Tensors(), as BF16
// or F32). It creates dir if needed.
func WriteCheckpoint(dir string, cfg *Config, tensors map[string][]float32, dtype string) error {
	for _, s := range cfg.Tensors() {
		if _, ok := tensors[s.Name]; !ok {
			return fmt.Errorf("model: writing checkpoint: missing tensor %s", s.Name)
		}
	}
	return WriteCheckpointFrom(dir, cfg, dtype, func(name string, dst []float32) error {
		if v := tensors[name]; len(v) != len(dst) {
			return fmt.Errorf("model: writing checkpoint: tensor %s has %d values, want %d", name, len(v), len(dst))
		}
		copy(dst, tensors[name])
		return nil
	})
}

// WriteCheckpointFrom is WriteCheckpoint with each tensor read from read
// (into dst, the tensor's length) as its turn comes, one tensor at a
// time: an export of a model larger than host memory.
func WriteCheckpointFrom(dir string, cfg *Config, dtype string, read func(name string, dst []float32) error) error {
	if dtype == "" {
		dtype = "BF16"
	}
	if dtype != "BF16" && dtype != "F32" {
		return fmt.Errorf("model: checkpoint dtype %q: want BF16 or F32", dtype)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	var v []float32
	var buf []byte
	var ts []StreamTensor
	for _, s := range cfg.Tensors() {
		s := s
		ts = append(ts, StreamTensor{Name: s.Name, DType: dtype, Shape: s.Shape, Bytes: func() ([]byte, error) {
			n := numel(s.Shape)
			if cap(v) < n {
				v = make([]float32, n)
			}
			v = v[:n]
			if err := read(s.Name, v); err != nil {
				return nil, err
			}
			if dtype == "F32" {
				buf = F32Bytes(buf, v)
			} else {
				buf = BF16Bytes(buf, v)
			}
			return buf, nil
		}})
	}
	if err := WriteSafetensorsStream(filepath.Join(dir, "model.safetensors"), ts, map[string]string{"format": "pt"}); err != nil {
		return err
	}
	// An F32 checkpoint said torch_dtype bfloat16, so that
	// transformers' torch_dtype="auto" rounded its exact weights.
	cj, err := cfg.jsonDType(map[string]string{"BF16": "bfloat16", "F32": "float32"}[dtype])
	if err != nil {
		return err
	}
	return atomicfile.WriteFile(filepath.Join(dir, "config.json"), append(cj, '\n'), 0o644)
}

// Preset returns a small config of an architecture for tests and demos;
// fields can be overridden afterwards.
func Preset(arch Arch) (*Config, error) {
	c := &Config{Arch: arch, VocabSize: 1000, Hidden: 64, Layers: 2, Heads: 4, KVHeads: 2, HeadDim: 16,
		Intermediate: 128, MaxPositions: 2048, RMSNormEps: 1e-6, RopeTheta: 10000, BOSTokenID: -1, EOSTokenID: -1}
	switch arch {
	case ArchLlama:
		c.RopeTheta = 500000
		c.RopeScaling = &RopeScaling{Factor: 8, LowFreqFactor: 1, HighFreqFactor: 4, OriginalMaxPos: 64}
	case ArchQwen2:
		c.AttentionBias = true
		c.TieEmbeddings = true
		c.RopeTheta = 1000000
	case ArchQwen3:
		c.QKNorm = true
		c.HeadDim = 32 // explicit head_dim != hidden/heads, as in Qwen3
		c.RopeTheta = 1000000
	case ArchQwen3MoE:
		c.QKNorm = true
		c.HeadDim = 32
		c.RopeTheta = 1000000
		c.Layers = 3
		c.NumExperts, c.ExpertsPerTok, c.MoEIntermediate, c.DecoderSparseStep = 8, 2, 32, 1
		c.NormTopKProb = true
		c.MLPOnlyLayers = []int{1}
		c.RouterAuxLossCoef = 0.001
	default:
		return nil, errkind.Errorf(ErrConfig, "unknown architecture %q: want llama, qwen2, qwen3 or qwen3_moe", arch)
	}
	return c, nil
}
