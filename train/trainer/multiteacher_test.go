package trainer

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"distill/cache"
	"distill/cache/cachetest"
	"distill/train/testcache"
)

// teacherSpec describes one hand-made teacher cache of the multi-teacher
// tests: the samples (tokens and masks) depend only on their index, as in
// handCache; the top-k on the teacher number (0: handCache's own) and k.
type teacherSpec struct {
	teacher uint64
	k       int
	chunk   int
	// edit, when set, changes the manifest or a sample before it is
	// written (mismatch tests).
	manifest func(m *cache.Manifest)
	sample   func(s *cache.Sample)
}

var mtLens = func() []int {
	lens := make([]int, 64)
	for i := range lens {
		lens[i] = 10 + (i*7)%23
	}
	return lens
}()

// mtCache writes the cache of spec over mtLens (V = 128, tokenizer "tok",
// dataset "d", every chunk committed).
func mtCache(t *testing.T, sp teacherSpec) string {
	t.Helper()
	dir := t.TempDir()
	const V = 128
	m := cache.Manifest{TeacherFingerprint: fmt.Sprintf("teacher-%d", sp.teacher), TokenizerFingerprint: "tok", DatasetFingerprint: "d",
		VocabSize: V, K: sp.k, Temperature: 1, Samples: int64(len(mtLens)), Encoding: cache.EncodingLossless}
	if sp.manifest != nil {
		sp.manifest(&m)
	}
	c, err := cache.Create(dir, m, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	for a := 0; a < len(mtLens); a += sp.chunk {
		b := min(a+sp.chunk, len(mtLens))
		w, err := c.BeginChunk(int64(a), int64(b))
		if err != nil {
			t.Fatal(err)
		}
		for i := a; i < b; i++ {
			g := cachetest.New(V, 8, "bpe", uint64(i)+1).Sample(mtLens[i])
			tk := cachetest.New(V, sp.k, "bpe", uint64(i)+1+1000*sp.teacher).Sample(mtLens[i])
			s := cache.Sample{Index: int64(i), Tokens: g.Tokens, Mask: g.Mask, TopKIDs: tk.TopKIDs, TopKLogProbs: tk.TopKLogProbs}
			if sp.sample != nil {
				sp.sample(&s)
			}
			if err := w.Add(s); err != nil {
				t.Fatal(err)
			}
		}
		if err := w.Commit(); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

// copyCache copies the cache directory dir into a new one: the same
// teacher's cache, as a second teacher of data.caches (one directory
// given twice is refused).
func copyCache(t *testing.T, dir string) string {
	t.Helper()
	dst := filepath.Join(t.TempDir(), "copy")
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(dir, p)
		if err != nil {
			return err
		}
		if d.IsDir() {
			return os.MkdirAll(filepath.Join(dst, rel), 0o755)
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		return os.WriteFile(filepath.Join(dst, rel), b, 0o644)
	})
	if err != nil {
		t.Fatal(err)
	}
	return dst
}

// mtConfig is the tiny training config of the trainer tests over the
// caches of data.caches (a YAML flow list), or over one cache when caches
// is a plain directory.
func mtConfig(t *testing.T, runDir, caches string, over ...string) *Config {
	t.Helper()
	base := []string{"model.tokenizer_fingerprint=tok", "model.random.vocab_size=128"}
	if strings.HasPrefix(caches, "[") {
		base = append(base, "data.cache=[]", "data.caches="+caches)
	} else {
		base = append(base, "data.cache=["+caches+"]")
	}
	return tinyConfig(t, &testcache.Built{CacheDir: "unused"}, runDir, append(base, over...)...)
}

// TestMultiTeacherHalvesEqualSingle: two caches of the same teacher at
// weights 0.5/0.5 train exactly as that cache alone: every step's loss,
// kd, ce and gradient norm, every eval and the final weights are
// bit-identical (0.5·a + 0.5·a = a in binary floating point, and the loss
// sums each position's weighted terms before adding them up). Each
// teacher's KD is the single run's KD, and metrics.jsonl and the log
// lines carry the per-teacher numbers.
func TestMultiTeacherHalvesEqualSingle(t *testing.T) {
	a := mtCache(t, teacherSpec{teacher: 1, k: 8, chunk: 16})
	a2 := copyCache(t, a) // the same teacher's cache in another directory: one directory twice is refused
	single, err := Run(mtConfig(t, filepath.Join(t.TempDir(), "single"), a), Options{Log: io.Discard})
	if err != nil {
		t.Fatal(err)
	}
	runDir := filepath.Join(t.TempDir(), "multi")
	var log strings.Builder
	multi, err := Run(mtConfig(t, runDir, fmt.Sprintf("[{dir: %s, weight: 0.5, name: a}, {dir: %s, weight: 0.5}]", a, a2)), Options{Log: &log})
	if err != nil {
		t.Fatal(err)
	}
	if len(multi.Steps) != 12 || len(single.Steps) != 12 {
		t.Fatalf("steps: %d multi, %d single", len(multi.Steps), len(single.Steps))
	}
	for i, s := range multi.Steps {
		w := single.Steps[i]
		if s.Loss != w.Loss || s.KD != w.KD || s.CE != w.CE || s.GradNorm != w.GradNorm || s.LossTokens != w.LossTokens {
			t.Fatalf("step %d: multi loss %.17g kd %.17g ce %.17g |g| %.17g, single %.17g %.17g %.17g %.17g", s.Step, s.Loss, s.KD, s.CE, s.GradNorm, w.Loss, w.KD, w.CE, w.GradNorm)
		}
		if len(s.Teachers) != 2 || s.Teachers[0].Name != "a" || s.Teachers[1].Name != "t1" || s.Teachers[0].Weight != 0.5 {
			t.Fatalf("step %d: teachers %+v", s.Step, s.Teachers)
		}
		for _, te := range s.Teachers {
			if math.Abs(te.KD-w.KD) > 1e-12*w.KD || te.Top1 < 0 || te.Top1 > 1 {
				t.Fatalf("step %d: teacher %+v, single kd %.17g", s.Step, te, w.KD)
			}
		}
		if s.Teachers[0].Top1 != s.Teachers[1].Top1 {
			t.Fatalf("step %d: identical teachers with different top-1 agreement: %+v", s.Step, s.Teachers)
		}
	}
	if len(multi.Evals) != len(single.Evals) {
		t.Fatalf("evals: %d multi, %d single", len(multi.Evals), len(single.Evals))
	}
	for i, e := range multi.Evals {
		w := single.Evals[i]
		if e.Loss != w.Loss || e.KD != w.KD || e.CE != w.CE || e.TokenAccuracy != w.TokenAccuracy || e.Top1Agreement != w.Top1Agreement {
			t.Fatalf("eval %d: multi %+v, single %+v", i, e, w)
		}
		if len(e.Teachers) != 2 || e.Teachers[0].Top1 != w.Top1Agreement || e.Teachers[1].Name != "t1" {
			t.Fatalf("eval %d: teachers %+v, single top-1 %v", i, e.Teachers, w.Top1Agreement)
		}
	}
	wa, _ := os.ReadFile(filepath.Join(single.Checkpoint, "model.safetensors"))
	wb, _ := os.ReadFile(filepath.Join(multi.Checkpoint, "model.safetensors"))
	if len(wa) == 0 || string(wa) != string(wb) {
		t.Fatal("final weights differ between the single-teacher run and two identical teachers at 0.5/0.5")
	}
	// metrics.jsonl: every train and eval line has both teachers.
	f, err := os.Open(filepath.Join(runDir, "metrics.jsonl"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	lines := 0
	for sc.Scan() {
		var l struct {
			Type     string           `json:"type"`
			Teachers []TeacherMetrics `json:"teachers"`
		}
		if err := json.Unmarshal(sc.Bytes(), &l); err != nil {
			t.Fatal(err)
		}
		if len(l.Teachers) != 2 || l.Teachers[0].Name != "a" || l.Teachers[1].Name != "t1" || !(l.Teachers[0].KD > 0) {
			t.Fatalf("metrics.jsonl line without the teachers: %s", sc.Text())
		}
		lines++
	}
	if lines != 12+2 {
		t.Fatalf("metrics.jsonl has %d lines, want 12 steps + 2 evals", lines)
	}
	// The resolved config.yaml loads back with the same teachers.
	rc, err := LoadConfig(filepath.Join(runDir, "config.yaml"), nil)
	if err != nil {
		t.Fatal(err)
	}
	if cs := rc.Data.Caches; len(cs) != 2 || cs[0].Name != "a" || cs[1].weight() != 0.5 || len(cs[1].Dir) != 1 || cs[1].Dir[0] != a2 {
		t.Fatalf("resolved config.yaml: data.caches %+v", cs)
	}
	if l := log.String(); !strings.Contains(l, "step 4/12 loss") || !strings.Contains(l, "[a kd ") || !strings.Contains(l, ", t1 kd ") ||
		!strings.Contains(l, " top1 ") || !strings.Contains(l, "eval step 12:") {
		t.Fatalf("log lines without the per-teacher numbers:\n%s", l)
	}
}

// TestMultiTeacherWeightZero: teachers A and B (another top-k, another k
// and another chunk layout, so the union and the secondary cache's reads
// are exercised) at weights 1/0 train as A alone. B widens the union, so
// A's tail is a sum over more terms and the gradient at B's ids comes from
// the host's coefficients instead of the kernel's (train/loss
// TestMultiWeightZero: loss to 1e-8, gradients to 1e-5 relative): step 1
// matches to 1e-8 relative (the same weights); later steps differ by those
// gradient differences carried through AdamW: 1e-6 relative over 12 steps
// (observed 3.4e-8). B's own KD is reported beside A's.
func TestMultiTeacherWeightZero(t *testing.T) {
	a := mtCache(t, teacherSpec{teacher: 1, k: 8, chunk: 16})
	b := mtCache(t, teacherSpec{teacher: 2, k: 5, chunk: 8})
	single, err := Run(mtConfig(t, filepath.Join(t.TempDir(), "single"), a), Options{Log: io.Discard})
	if err != nil {
		t.Fatal(err)
	}
	multi, err := Run(mtConfig(t, filepath.Join(t.TempDir(), "multi"), fmt.Sprintf("[{dir: %s, weight: 1}, {dir: %s, weight: 0, name: b}]", a, b)), Options{Log: io.Discard})
	if err != nil {
		t.Fatal(err)
	}
	rel := func(got, want float64) float64 { return math.Abs(got-want) / math.Abs(want) }
	var maxRel float64
	for i, s := range multi.Steps {
		w := single.Steps[i]
		tol := 1e-6
		if i == 0 {
			tol = 1e-8
		}
		for _, d := range []float64{rel(s.Loss, w.Loss), rel(s.KD, w.KD), rel(s.GradNorm, w.GradNorm), rel(s.Teachers[0].KD, w.KD)} {
			if !(d <= tol) {
				t.Fatalf("step %d: multi loss %.10g kd %.10g |g| %.10g teacher 0 kd %.10g, A alone %.10g %.10g %.10g (tolerance %g)",
					s.Step, s.Loss, s.KD, s.GradNorm, s.Teachers[0].KD, w.Loss, w.KD, w.GradNorm, tol)
			}
			maxRel = max(maxRel, d)
		}
		if s.Teachers[1].Name != "b" || !(s.Teachers[1].KD > 0) || s.Teachers[1].KD == s.Teachers[0].KD {
			t.Fatalf("step %d: teacher b %+v beside a %+v", s.Step, s.Teachers[1], s.Teachers[0])
		}
	}
	t.Logf("largest relative difference from A alone over 12 steps: %.3g", maxRel)
}

// TestMultiTeacherResume: two different teachers (different chunk
// layouts), 12 steps straight versus 6 abandoned after the checkpoint at
// step 4 and a resume: steps 5..12 (with each teacher's numbers), the
// evals and the final weights are bit-identical. A resume with another
// teacher is refused, naming it; a change of weights is allowed and said.
func TestMultiTeacherResume(t *testing.T) {
	a := mtCache(t, teacherSpec{teacher: 1, k: 8, chunk: 16})
	b := mtCache(t, teacherSpec{teacher: 2, k: 6, chunk: 12})
	caches := fmt.Sprintf("[{dir: %s, weight: 0.7}, {dir: %s, weight: 0.3}]", a, b)
	full, err := Run(mtConfig(t, filepath.Join(t.TempDir(), "full"), caches), Options{Log: io.Discard})
	if err != nil {
		t.Fatal(err)
	}
	runDir := filepath.Join(t.TempDir(), "resumed")
	if _, err := Run(mtConfig(t, runDir, caches), Options{Log: io.Discard, StopAfter: 6}); err != nil {
		t.Fatal(err)
	}
	// Another teacher in place of b (a's, in a directory of its own):
	// refused before any step.
	_, err = Run(mtConfig(t, runDir, fmt.Sprintf("[{dir: %s, weight: 0.7}, {dir: %s, weight: 0.3}]", a, copyCache(t, a))), Options{Log: io.Discard})
	if !errors.Is(err, ErrResume) || !strings.Contains(err.Error(), "data.caches[1]") || !strings.Contains(err.Error(), "teacher-2") {
		t.Fatalf("resume with another teacher: %v", err)
	}
	_, err = Run(mtConfig(t, runDir, a), Options{Log: io.Discard})
	if !errors.Is(err, ErrResume) || !strings.Contains(err.Error(), "trained with 2 teachers") {
		t.Fatalf("resume with one teacher: %v", err)
	}
	rest, err := Run(mtConfig(t, runDir, caches), Options{Log: io.Discard})
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasSuffix(rest.Resumed, "step-00000004") || len(rest.Steps) != 8 {
		t.Fatalf("resumed from %q, ran %d steps", rest.Resumed, len(rest.Steps))
	}
	for i, s := range rest.Steps {
		w := full.Steps[4+i]
		if s.Step != w.Step || s.Loss != w.Loss || s.GradNorm != w.GradNorm || s.KD != w.KD || !reflect.DeepEqual(s.Teachers, w.Teachers) {
			t.Fatalf("step %d after resume: loss %.17g |g| %.17g %+v, uninterrupted %.17g %.17g %+v", s.Step, s.Loss, s.GradNorm, s.Teachers, w.Loss, w.GradNorm, w.Teachers)
		}
	}
	if len(rest.Evals) == 0 || !reflect.DeepEqual(rest.Evals[len(rest.Evals)-1], full.Evals[len(full.Evals)-1]) {
		t.Fatalf("final eval after resume %+v, uninterrupted %+v", rest.Evals, full.Evals)
	}
	wa, _ := os.ReadFile(filepath.Join(full.Checkpoint, "model.safetensors"))
	wb, _ := os.ReadFile(filepath.Join(rest.Checkpoint, "model.safetensors"))
	if len(wa) == 0 || string(wa) != string(wb) {
		t.Fatal("final weights differ between the straight and the resumed run")
	}
	// New weights on resume: allowed, and said.
	var log strings.Builder
	if _, err := Run(mtConfig(t, runDir, fmt.Sprintf("[{dir: %s, weight: 0.5}, {dir: %s, weight: 0.5}]", a, b), "train.max_steps=13"), Options{Log: &log}); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(log.String(), "teacher weights changed (t0 0.7 -> 0.5, t1 0.3 -> 0.5)") {
		t.Fatalf("log of a resume with new weights:\n%s", log.String())
	}
}

// TestMultiTeacherMismatch: caches that do not describe the same samples,
// or a teacher that does not share the student's vocabulary or tokenizer,
// are refused before the first step with an error naming the teacher, the
// field and both values; a sample whose tokens or mask differ is refused
// when it is read, naming the sample and the position.
func TestMultiTeacherMismatch(t *testing.T) {
	a := mtCache(t, teacherSpec{teacher: 1, k: 8, chunk: 16})
	for _, c := range []struct {
		name string
		sp   teacherSpec
		want []string
	}{
		{"vocab", teacherSpec{manifest: func(m *cache.Manifest) { m.VocabSize = 200 }}, []string{"vocab_size 200", "has 128"}},
		{"tokenizer", teacherSpec{manifest: func(m *cache.Manifest) { m.TokenizerFingerprint = "other-tok" }}, []string{"tokenizer other-tok", "share the student's tokenizer"}},
		{"dataset", teacherSpec{manifest: func(m *cache.Manifest) { m.DatasetFingerprint = "d2" }}, []string{"dataset fingerprint d2", "same samples"}},
		{"temperature", teacherSpec{manifest: func(m *cache.Manifest) { m.Temperature = 2 }}, []string{"capture temperature 2", "one capture temperature"}},
		{"tokens", teacherSpec{sample: func(s *cache.Sample) {
			if s.Index%5 == 3 {
				s.Tokens[4] = (s.Tokens[4] + 1) % 128
			}
		}}, []string{"differs between teacher t0", "token 4 is"}},
		{"mask", teacherSpec{sample: func(s *cache.Sample) {
			if s.Index%5 == 3 {
				s.Mask[6] ^= 1
			}
		}}, []string{"differs between teacher t0", "loss mask at token 6"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			c.sp.teacher, c.sp.k, c.sp.chunk = 2, 4, 16
			b := mtCache(t, c.sp)
			_, err := Run(mtConfig(t, filepath.Join(t.TempDir(), "run"), fmt.Sprintf("[{dir: %s}, {dir: %s}]", a, b)), Options{Log: io.Discard})
			if !errors.Is(err, ErrMismatch) {
				t.Fatalf("err = %v, want ErrMismatch", err)
			}
			for _, w := range append(c.want, "data.caches[1]", b) {
				if !strings.Contains(err.Error(), w) {
					t.Fatalf("err = %v, want it to mention %q", err, w)
				}
			}
		})
	}
	// A teacher whose cache lacks samples teacher 0 has.
	t.Run("missing", func(t *testing.T) {
		dir := t.TempDir()
		m := cache.Manifest{TeacherFingerprint: "teacher-3", TokenizerFingerprint: "tok", DatasetFingerprint: "d",
			VocabSize: 128, K: 4, Temperature: 1, Samples: int64(len(mtLens)), Encoding: cache.EncodingLossless}
		c, err := cache.Create(dir, m, nil)
		if err != nil {
			t.Fatal(err)
		}
		c.Close()
		_, err = Run(mtConfig(t, filepath.Join(t.TempDir(), "run"), fmt.Sprintf("[{dir: %s}, {dir: %s}]", a, dir)), Options{Log: io.Discard})
		if !errors.Is(err, ErrMismatch) || !strings.Contains(err.Error(), "samples [0, 16) are in teacher t0") {
			t.Fatalf("err = %v", err)
		}
	})
}

// TestMultiTeacherConfig: data.caches keys are checked on their own,
// naming the key.
func TestMultiTeacherConfig(t *testing.T) {
	for _, c := range []struct {
		caches string
		over   []string
		want   string
	}{
		{"[{dir: a}, {dir: b, weight: -1}]", nil, "data.caches[1].weight: -1"},
		{"[{dir: a, weight: 0}, {dir: b, weight: 0}]", nil, "every teacher's weight is 0"},
		{"[{dir: a, name: x}, {dir: b, name: x}]", nil, `data.caches[1].name: "x" is also the name of data.caches[0]`},
		{"[{dir: a, name: t1}, {dir: b}]", nil, `data.caches[1].name: "t1" is also`},
		{"[{dir: a, name: 'a b'}]", nil, `data.caches[0].name: "a b": use letters`},
		{"[{name: x}]", nil, "data.caches[0].dir: required"},
		{"[{dir: a}]", []string{"data.cache=[c]"}, "set only one of data.cache (one teacher's cache) and data.caches"},
	} {
		base := []string{"model.tokenizer_fingerprint=tok", "data.cache=[]", "data.caches=" + c.caches}
		p := filepath.Join(t.TempDir(), "cfg.yaml")
		os.WriteFile(p, []byte("run_dir: r\nmodel: {random: {arch: qwen3}}\n"), 0o644)
		_, err := LoadConfig(p, append(base, c.over...))
		if !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s %v: err = %v, want %q", c.caches, c.over, err, c.want)
		}
	}
	// dir takes one directory or a list (one cache in several directories).
	p := filepath.Join(t.TempDir(), "cfg.yaml")
	os.WriteFile(p, []byte("run_dir: r\nmodel: {random: {arch: qwen3}}\ndata:\n  caches:\n    - dir: a\n    - {dir: [b, c], name: big, weight: 2}\n"), 0o644)
	cfg, err := LoadConfig(p, nil)
	if err != nil {
		t.Fatal(err)
	}
	got := cfg.Data.Caches
	if len(got) != 2 || !reflect.DeepEqual([]string(got[0].Dir), []string{"a"}) || !reflect.DeepEqual([]string(got[1].Dir), []string{"b", "c"}) ||
		got[0].teacherName(0) != "t0" || got[0].weight() != 1 || got[1].teacherName(1) != "big" || got[1].weight() != 2 {
		t.Fatalf("caches %+v", got)
	}
}

// TestMultiTeacherSameCacheTwice: one cache given to two teachers of
// data.caches trained silently as one teacher at the sum of the weights;
// it is refused at load, naming both entries and the fix, whether the
// two paths are the same text, a relative and an absolute path, or a
// symlink to the directory. A directory shared by two teachers'
// directory lists is refused too; two copies of a cache are two caches.
func TestMultiTeacherSameCacheTwice(t *testing.T) {
	root := t.TempDir()
	a, b := filepath.Join(root, "a"), filepath.Join(root, "b")
	os.Mkdir(a, 0o755)
	os.Mkdir(b, 0o755)
	link := filepath.Join(root, "link")
	if err := os.Symlink(a, link); err != nil {
		t.Fatal(err)
	}
	t.Chdir(root)
	p := filepath.Join(root, "cfg.yaml")
	os.WriteFile(p, []byte("run_dir: r\nmodel: {random: {arch: qwen3}}\n"), 0o644)
	missing := filepath.Join(root, "not-yet")
	for _, c := range []struct {
		caches string
		want   []string
	}{
		{fmt.Sprintf("[{dir: %s}, {dir: %s}]", a, a), []string{"data.caches[1] (" + a + ") is the same cache as data.caches[0]: ", "give it once (with weight: 2, the sum of both entries' weights, it trains as now), or correct the path"}},
		{fmt.Sprintf("[{dir: %s, weight: 0.5}, {dir: b}, {dir: %s, weight: 0.25}]", link, a), []string{"data.caches[2] (" + a + ") is the same cache as data.caches[0] (" + link + ")", "with weight: 0.75,"}},
		{fmt.Sprintf("[{dir: a}, {dir: %s}]", a), []string{"data.caches[1] (" + a + ") is the same cache as data.caches[0] (a)"}},
		{fmt.Sprintf("[{dir: %s}, {dir: %s/}]", missing, missing), []string{"data.caches[1] (" + missing + "/) is the same cache as data.caches[0] (" + missing + ")"}},
		{fmt.Sprintf("[{dir: [%s, %s]}, {dir: %s}]", a, b, link), []string{"data.caches[1].dir: " + link + " is also a directory of data.caches[0] (" + a + ")", "give each directory to one teacher"}},
	} {
		_, err := LoadConfig(p, []string{"data.caches=" + c.caches})
		for _, w := range c.want {
			if !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), w) {
				t.Errorf("%s: err = %v, want %q", c.caches, err, w)
			}
		}
	}
	if _, err := LoadConfig(p, []string{fmt.Sprintf("data.caches=[{dir: %s}, {dir: %s}]", a, b)}); err != nil {
		t.Errorf("two caches: %v", err)
	}
}

// TestMultiTeacherDocs: examples/multiteacher.yaml loads with its two
// teachers, and examples/train.yaml's commented data.caches block,
// uncommented in place of data.cache, loads too (its keys are spelled as
// the config reads them).
func TestMultiTeacherDocs(t *testing.T) {
	c, err := LoadConfig("../../examples/multiteacher.yaml", nil)
	if err != nil {
		t.Fatal(err)
	}
	if cs := c.Data.Caches; len(cs) != 2 || cs[0].teacherName(0) != "general" || cs[1].weight() != 0.3 {
		t.Fatalf("examples/multiteacher.yaml: %+v", c.Data)
	}
	b, err := os.ReadFile("../../examples/train.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	in := false
	for _, line := range strings.Split(string(b), "\n") {
		switch {
		case strings.HasPrefix(line, "  cache:"):
			continue
		case strings.HasPrefix(line, "  # caches:"):
			in = true
		case in && !strings.HasPrefix(line, "  #   "):
			in = false
		}
		if in {
			line = "  " + strings.TrimPrefix(line, "  # ")
		}
		out = append(out, line)
	}
	p := filepath.Join(t.TempDir(), "multi.yaml")
	os.WriteFile(p, []byte(strings.Join(out, "\n")), 0o644)
	c, err = LoadConfig(p, nil)
	if err != nil {
		t.Fatalf("examples/train.yaml's data.caches block: %v", err)
	}
	if cs := c.Data.Caches; len(cs) != 2 || cs[0].teacherName(0) != "a" || cs[0].weight() != 0.7 || len(cs[1].Dir) != 2 || cs[1].weight() != 0.3 {
		t.Fatalf("examples/train.yaml's data.caches block read as %+v", cs)
	}
}

// TestMultiTeacherTruncate: with data.truncate, a sample cut to seq_len
// has every teacher's top-k cut alike (else the row's teachers would not
// match its tokens and the loss would refuse it), and two identical
// teachers at 0.5/0.5 still equal the single teacher.
func TestMultiTeacherTruncate(t *testing.T) {
	a := mtCache(t, teacherSpec{teacher: 1, k: 8, chunk: 16})
	b := mtCache(t, teacherSpec{teacher: 2, k: 3, chunk: 16})
	over := []string{"data.seq_len=20", "data.truncate=true", "train.max_steps=3", "eval.every=0", "checkpoint.every=0"}
	single, err := Run(mtConfig(t, filepath.Join(t.TempDir(), "single"), a, over...), Options{Log: io.Discard})
	if err != nil {
		t.Fatal(err)
	}
	halves, err := Run(mtConfig(t, filepath.Join(t.TempDir(), "halves"), fmt.Sprintf("[{dir: %s, weight: 0.5}, {dir: %s, weight: 0.5}]", a, copyCache(t, a)), over...), Options{Log: io.Discard})
	if err != nil {
		t.Fatal(err)
	}
	for i, s := range halves.Steps {
		if w := single.Steps[i]; s.Loss != w.Loss || s.GradNorm != w.GradNorm || s.Tokens != w.Tokens {
			t.Fatalf("step %d: halves loss %.17g |g| %.17g tokens %d, single %.17g %.17g %d", s.Step, s.Loss, s.GradNorm, s.Tokens, w.Loss, w.GradNorm, w.Tokens)
		}
	}
	if _, err := Run(mtConfig(t, filepath.Join(t.TempDir(), "two"), fmt.Sprintf("[{dir: %s}, {dir: %s}]", a, b), over...), Options{Log: io.Discard}); err != nil {
		t.Fatalf("two teachers with truncated samples: %v", err)
	}
}
