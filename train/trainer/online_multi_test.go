package trainer

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"distill/cache"
	"distill/model"
)

// teachersOver is the override of distill.teachers with two teachers a
// and b at the given weights.
func teachersOver(a, b string, wa, wb float64) string {
	return fmt.Sprintf("distill.teachers=[{addrs: [%s], name: a, weight: %g}, {addrs: [%s], name: b, weight: %g}]", a, wa, b, wb)
}

// sameTeachers fails unless a and b report bit-identical per-teacher
// metrics, step for step and eval for eval, and have two teachers.
func sameTeachers(t *testing.T, what string, a, b *Result) {
	t.Helper()
	for i := range a.Steps {
		if len(a.Steps[i].Teachers) != 2 || !reflect.DeepEqual(a.Steps[i].Teachers, b.Steps[i].Teachers) {
			t.Fatalf("%s: step %d: teachers %+v vs %+v", what, a.Steps[i].Step, a.Steps[i].Teachers, b.Steps[i].Teachers)
		}
	}
	for i := range a.Evals {
		if len(a.Evals[i].Teachers) != 2 || !reflect.DeepEqual(a.Evals[i].Teachers, b.Evals[i].Teachers) {
			t.Fatalf("%s: eval %d: teachers %+v vs %+v", what, i, a.Evals[i].Teachers, b.Evals[i].Teachers)
		}
	}
}

// TestOnlineMultiMatchesOffline is the multi-teacher exactness test: two
// online teachers (different tiny models, one sample per forward pass)
// give the losses, per-teacher KD and top-1 agreement, and evals of the
// offline data.caches run over caches the same daemons filled from the
// same data, step for step and bit for bit.
func TestOnlineMultiMatchesOffline(t *testing.T) {
	f := newOnlineFixture(t, 40)
	ta := startTeacherd(t, f.teacher, f.tokDir, filepath.Join(t.TempDir(), "ca"), filepath.Dir(f.file))
	tb := startTeacherd(t, teacherModel(t, 64, 1), f.tokDir, filepath.Join(t.TempDir(), "cb"), filepath.Dir(f.file))
	on := onlineConfig(t, f.tokDir, f.file, filepath.Join(t.TempDir(), "online"), "", []string{ta.addr()}, teachersOver(ta.addr(), tb.addr(), 0.7, 0.3))
	ca, cb := fillCache(t, ta, on), fillCache(t, tb, on)
	off := onlineConfig(t, f.tokDir, f.file, filepath.Join(t.TempDir(), "offline"), ca, nil,
		"data.cache=[]", fmt.Sprintf("data.caches=[{dir: %s, name: a, weight: 0.7}, {dir: %s, name: b, weight: 0.3}]", ca, cb))
	ro, _ := run(t, off, Options{})
	rn, log := run(t, on, Options{})
	sameLosses(t, "two online teachers vs data.caches", rn, ro)
	sameTeachers(t, "two online teachers vs data.caches", rn, ro)
	if te := rn.Steps[0].Teachers; te[0].Name != "a" || te[1].Name != "b" || te[0].Weight != 0.7 || te[0].KD == te[1].KD {
		t.Fatalf("per-teacher metrics of different teachers: %+v", te)
	}
	for _, w := range []string{"teachers: teacher a: qwen3", "teachers: teacher b: qwen3", "weight 0.3"} {
		if !strings.Contains(log, w) {
			t.Errorf("log lacks %q:\n%s", w, log)
		}
	}
	// The checkpoints record both teachers, as data.caches does.
	var st State
	if b, err := os.ReadFile(filepath.Join(rn.Checkpoint, "state.json")); err != nil || json.Unmarshal(b, &st) != nil {
		t.Fatalf("state.json of %s: %v", rn.Checkpoint, err)
	}
	if len(st.Teachers) != 2 || st.Teachers[0].Name != "a" || st.Teachers[1].Weight != 0.3 || st.Teachers[0].Fingerprint == st.Teachers[1].Fingerprint || st.Teachers[0].Fingerprint == "" {
		t.Fatalf("checkpoint teachers: %+v", st.Teachers)
	}
}

// TestOnlineMultiHalvesEqualSingle: the same teacher twice at weights
// 0.5/0.5 trains bit for bit as that teacher alone (0.5·a + 0.5·a = a),
// and each teacher's KD is the single run's.
func TestOnlineMultiHalvesEqualSingle(t *testing.T) {
	f := newOnlineFixture(t, 40)
	a := startTeacherd(t, f.teacher, f.tokDir, "", "")
	b := startTeacherd(t, f.teacher, f.tokDir, "", "")
	single := f.reference(t, a.addr())
	multi, _ := run(t, onlineConfig(t, f.tokDir, f.file, filepath.Join(t.TempDir(), "multi"), "", []string{a.addr()}, teachersOver(a.addr(), b.addr(), 0.5, 0.5)), Options{})
	sameLosses(t, "two identical teachers at 0.5/0.5 vs one", multi, single)
	for i, s := range multi.Steps {
		if len(s.Teachers) != 2 || s.Teachers[0].KD != single.Steps[i].KD || s.Teachers[1].KD != single.Steps[i].KD || s.Teachers[0].Top1 != s.Teachers[1].Top1 {
			t.Fatalf("step %d: teachers %+v, single kd %v", s.Step, s.Teachers, single.Steps[i].KD)
		}
	}
}

// TestOnlineMultiWriteCache: with two teachers, distill.write_cache DIR
// holds one cache per teacher, DIR/a and DIR/b, each of whole chunks
// only (Check passes) after a stopped run; the resumed run reuses them
// and ends as a run without the stop; resuming with the teachers in
// another order is refused naming the entry; a new run on the full
// caches asks no teacher and gives the same losses, and so does an
// offline data.caches run over DIR/a and DIR/b; one teacher's cache as
// the write_cache of several is refused.
func TestOnlineMultiWriteCache(t *testing.T) {
	fastRetry(t)
	f := newOnlineFixture(t, 40)
	ta := startTeacherd(t, f.teacher, f.tokDir, "", "")
	tb := startTeacherd(t, teacherModel(t, 64, 1), f.tokDir, "", "")
	teachers := teachersOver(ta.addr(), tb.addr(), 0.6, 0.4)
	over := []string{teachers, "distill.write_encoding=lossless", "train.max_steps=20"} // 16 steps an epoch
	ref, _ := run(t, onlineConfig(t, f.tokDir, f.file, filepath.Join(t.TempDir(), "ref"), "", []string{ta.addr()}, over...), Options{})
	wdir := filepath.Join(t.TempDir(), "wc")
	over = append(over, "distill.write_cache="+wdir)
	var asked atomic.Int64
	testHookAnswer = func(string, int64) { asked.Add(1) }
	cfg := onlineConfig(t, f.tokDir, f.file, filepath.Join(t.TempDir(), "run"), "", []string{ta.addr()}, over...)
	run(t, cfg, Options{StopAfter: 5})
	held := map[cache.Range]int{} // chunk -> how many of the two write caches hold it
	var chunks []cache.ReaderChunk
	for _, name := range []string{"a", "b"} {
		dir := filepath.Join(wdir, name)
		rep, err := cache.Check(dir, nil)
		if err != nil {
			t.Fatal(err)
		}
		if !rep.OK() {
			t.Fatalf("write cache %s fails Check: %+v", dir, rep)
		}
		rd, err := cache.OpenReader(dir)
		if err != nil {
			t.Fatal(err)
		}
		if len(rd.Chunks()) == 0 {
			t.Fatalf("write cache %s has no chunk after 5 steps", dir)
		}
		for _, ch := range rd.Chunks() {
			if ch.Start%8 != 0 || ch.End-ch.Start != 8 {
				t.Fatalf("%s: chunk %v is not a whole chunk of 8", dir, ch.Range)
			}
			if held[ch.Range]++; held[ch.Range] == 2 {
				chunks = append(chunks, ch) // both teachers' answers are cached
			}
		}
	}
	// The teachers in another order: another objective, refused.
	swapped := onlineConfig(t, f.tokDir, f.file, cfg.RunDir, "", []string{ta.addr()},
		fmt.Sprintf("distill.teachers=[{addrs: [%s], name: b, weight: 0.4}, {addrs: [%s], name: a, weight: 0.6}]", tb.addr(), ta.addr()), "distill.write_encoding=lossless", "train.max_steps=20", "distill.write_cache="+wdir)
	var log bytes.Buffer
	if _, err := Run(swapped, Options{Log: &log}); !errors.Is(err, ErrResume) || !strings.Contains(err.Error(), "distill.teachers[0]") {
		t.Fatalf("resume with the teachers swapped: %v\n%s", err, log.String())
	}
	first := asked.Load()
	asked.Store(0)
	// Which samples the resumed run asks, not how many (that depends on
	// how far the prefetch runs ahead): none that both write caches hold.
	reused := askedFrom(t, chunks)
	res, _ := run(t, cfg, Options{})
	reused(t)
	t.Logf("the first run asked %d samples, the resumed run %d", first, asked.Load())
	tail := &Result{Steps: ref.Steps[len(ref.Steps)-len(res.Steps):], Evals: ref.Evals[len(ref.Evals)-len(res.Evals):]}
	sameLosses(t, "resumed with the write caches vs no stop", res, tail)
	sameTeachers(t, "resumed with the write caches vs no stop", res, tail)
	asked.Store(0)
	res, _ = run(t, onlineConfig(t, f.tokDir, f.file, filepath.Join(t.TempDir(), "run2"), "", []string{ta.addr()}, over...), Options{})
	if asked.Load() != 0 {
		t.Errorf("a run on the full write caches asked the teachers %d samples, want 0", asked.Load())
	}
	sameLosses(t, "from the write caches vs asking", res, ref)
	sameTeachers(t, "from the write caches vs asking", res, ref)
	off := onlineConfig(t, f.tokDir, f.file, filepath.Join(t.TempDir(), "offline"), filepath.Join(wdir, "a"), nil, "train.max_steps=20",
		"data.cache=[]", fmt.Sprintf("data.caches=[{dir: %s, name: a, weight: 0.6}, {dir: %s, name: b, weight: 0.4}]", filepath.Join(wdir, "a"), filepath.Join(wdir, "b")))
	res, _ = run(t, off, Options{})
	sameLosses(t, "data.caches over the write caches vs asking", res, ref)
	// One teacher's cache as the root of several teachers' caches: refused
	// before anything is asked or written.
	nested := onlineConfig(t, f.tokDir, f.file, filepath.Join(t.TempDir(), "nested"), "", []string{ta.addr()}, teachers, "distill.write_cache="+filepath.Join(wdir, "a"))
	if _, err := Run(nested, Options{Log: &log}); !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), "is the cache of one teacher") || !strings.Contains(err.Error(), "<name>") {
		t.Fatalf("write_cache inside a teacher's cache: %v", err)
	}
}

// TestOnlineMultiPause: teacher b's only replica dies mid-run; training
// pauses (a sample is trained only once every teacher answered it),
// names b, and resumes when b is back; the losses are those of a run
// without the fault.
func TestOnlineMultiPause(t *testing.T) {
	fastRetry(t)
	f := newOnlineFixture(t, 40)
	ta := startTeacherd(t, f.teacher, f.tokDir, "", "")
	tb := startTeacherd(t, teacherModel(t, 64, 1), f.tokDir, "", "")
	teachers := teachersOver(ta.addr(), tb.addr(), 0.5, 1.5)
	ref, _ := run(t, onlineConfig(t, f.tokDir, f.file, filepath.Join(t.TempDir(), "ref"), "", []string{ta.addr()}, teachers), Options{})
	var killed sync.Once
	testHookAnswer = func(addr string, n int64) {
		if addr == tb.addr() && n == 7 {
			killed.Do(tb.kill)
		}
	}
	testHookPause = func() { go tb.start() } // restarted only once the run has paused
	res, log := run(t, onlineConfig(t, f.tokDir, f.file, filepath.Join(t.TempDir(), "run"), "", []string{ta.addr()}, teachers), Options{})
	sameLosses(t, "teacher b paused and resumed vs no fault", res, ref)
	sameTeachers(t, "teacher b paused and resumed vs no fault", res, ref)
	for _, want := range []string{"no replica of teacher b is reachable", "training paused", "teacher b is reachable again"} {
		if !strings.Contains(log, want) {
			t.Errorf("log lacks %q:\n%s", want, log)
		}
	}
}

// TestOnlineMultiDocs: the two-teacher distill.teachers blocks of
// examples/train.yaml and examples/online.yaml, uncommented in place of
// examples/online.yaml's teachers, load as two named, weighted teachers.
func TestOnlineMultiDocs(t *testing.T) {
	b, err := os.ReadFile("../../examples/online.yaml")
	if err != nil {
		t.Fatal(err)
	}
	online := string(b)
	one := "  teachers:\n    - addrs: [10.0.0.5:7070, 10.0.0.6:7070]   # replicas of one teacher\n      name: qwen3-8b\n"
	if !strings.Contains(online, one) {
		t.Fatalf("examples/online.yaml lacks its teachers block %q", one)
	}
	// block returns the commented block of src that starts with the line
	// prefix+"teachers:", uncommented and indented under distill.
	block := func(src, prefix, cont string) string {
		var out []string
		in := false
		for _, line := range strings.Split(src, "\n") {
			switch {
			case strings.HasPrefix(line, prefix+"teachers:"):
				in = true
			case in && !strings.HasPrefix(line, cont):
				in = false
			}
			if in {
				out = append(out, "  "+strings.TrimPrefix(line, prefix))
			}
		}
		return strings.Join(out, "\n") + "\n"
	}
	tb, err := os.ReadFile("../../examples/train.yaml")
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		what, block string
		names       []string
		weights     []float64
	}{
		{"examples/train.yaml", block(string(tb), "  # ", "  #   "), []string{"big", "small"}, []float64{0.7, 0.3}},
		{"examples/online.yaml", block(online, "#   ", "#     "), []string{"qwen3-8b", "qwen3-4b"}, []float64{0.7, 0.3}},
	} {
		p := filepath.Join(t.TempDir(), "multi.yaml")
		os.WriteFile(p, []byte(strings.Replace(online, one, c.block, 1)), 0o644)
		cfg, err := LoadConfig(p, nil)
		if err != nil {
			t.Fatalf("%s's two-teacher block:\n%s%v", c.what, c.block, err)
		}
		ts := cfg.Distill.Teachers
		if len(ts) != 2 {
			t.Fatalf("%s's two-teacher block read as %+v", c.what, ts)
		}
		for i := range ts {
			if ts[i].Name != c.names[i] || ts[i].Weight != c.weights[i] || len(ts[i].Addrs) == 0 {
				t.Fatalf("%s's two-teacher block read as %+v", c.what, ts)
			}
		}
	}
}

// TestOnlineMultiInfoChecks: every teacher's replicas are checked before
// step 1, and a second teacher whose vocabulary or tokenizer is not the
// student's is refused naming that teacher and the mismatch.
func TestOnlineMultiInfoChecks(t *testing.T) {
	fastRetry(t)
	f := newOnlineFixture(t, 20)
	good := startTeacherd(t, f.teacher, f.tokDir, "", "")
	bigVocab := t.TempDir()
	mc, _ := model.Preset(model.ArchQwen3)
	mc.VocabSize, mc.Hidden, mc.Layers, mc.Intermediate, mc.MaxPositions, mc.Heads, mc.KVHeads, mc.HeadDim = 300, 32, 1, 64, 256, 4, 2, 8
	model.WriteCheckpoint(bigVocab, mc, model.Init(mc, model.InitOptions{Seed: 5}), "BF16")
	wrongVocab := startTeacherd(t, bigVocab, f.tokDir, "", "")
	cfg := onlineConfig(t, f.tokDir, f.file, filepath.Join(t.TempDir(), "run"), "", []string{good.addr()}, teachersOver(good.addr(), wrongVocab.addr(), 1, 1))
	var log bytes.Buffer
	res, err := Run(cfg, Options{Log: &log})
	if !errors.Is(err, ErrMismatch) || !strings.Contains(err.Error(), "teacher b at "+wrongVocab.addr()) || !strings.Contains(err.Error(), "vocab_size 300, but the student has 260") {
		t.Fatalf("want the mismatch of teacher b, got %v\n%s", err, log.String())
	}
	if res != nil && len(res.Steps) > 0 {
		t.Fatalf("trained %d steps before the check failed", len(res.Steps))
	}
}
