// Command targetbias measures the bias of each kind of sparse teacher
// target (issue 27's measurement, after Anshumann et al., ACL 2025): at
// every counted position of the held-out samples, the angle between the
// gradient the loss takes on the student's logits from a cache's target
// and the gradient of the exact full-vocabulary forward KL, q - p, where p
// is the teacher's full distribution (its whole LM head, computed here)
// and q the student's. The mean of the positions' angles is the paper's
// figure: for a top-k target it is its bias; for a sampled one it is
// mostly the noise of N draws, which averages out over positions (the
// target is unbiased): the angle between the sums over all positions of
// the two gradients ("summed") shows how much remains.
//
// The gradients are those the loss package's doc defines (train/loss, at
// temperature 1, fwd_kl): for a top-k cache under tail bucket, q_v - p_v
// on K and q_v - p_tail·q_v/q_tail outside; renormalize, q̃_v - p̃_v on K
// and 0 outside; zero, q_v - p̃_v on K and q_v outside; for the sampled
// kinds, q_v - r_v with r the cache's sparse target.
//
//	targetbias --teacher DIR --student DIR --cache NAME=DIR [--cache ...] [--range 0:200]
//
// It prints one line per cache and tail mode: the cache's chunk bytes on
// disk a token (over the range: fill the caches with that range only),
// the mean angle in degrees and the mean cosine over the counted
// positions.
package main

import (
	"flag"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"distill/cache"
	"distill/train"
)

type cacheFlag []string

func (c *cacheFlag) String() string     { return strings.Join(*c, ",") }
func (c *cacheFlag) Set(s string) error { *c = append(*c, s); return nil }

func main() {
	teacherDir := flag.String("teacher", "", "the teacher's HF checkpoint directory")
	studentDir := flag.String("student", "", "the student's HF checkpoint directory (its q)")
	rng := flag.String("range", "0:200", "samples S:E of the caches")
	var caches cacheFlag
	flag.Var(&caches, "cache", "NAME=DIR: a cache of the samples (repeatable; its kind is read from its manifest)")
	flag.Parse()
	if err := run(*teacherDir, *studentDir, *rng, caches); err != nil {
		fmt.Fprintln(os.Stderr, "targetbias:", err)
		os.Exit(1)
	}
}

// measure accumulates one target's angles.
type measure struct {
	name       string
	angle, cos float64
	n          int
	sum, sumF  []float64 // the gradients summed over the positions
	bytes      float64   // the cache's chunk bytes a token (every position, on disk)
}

func (m *measure) add(g, full []float64) {
	var dot, a, b float64
	for i := range g {
		dot += g[i] * full[i]
		a += g[i] * g[i]
		b += full[i] * full[i]
	}
	c := dot / math.Sqrt(a*b)
	if m.sum == nil {
		m.sum, m.sumF = make([]float64, len(g)), make([]float64, len(g))
	}
	for i := range g {
		m.sum[i] += g[i]
		m.sumF[i] += full[i]
	}
	m.cos += c
	m.angle += math.Acos(math.Max(-1, math.Min(1, c))) * 180 / math.Pi
	m.n++
}

func run(teacherDir, studentDir, rng string, caches []string) error {
	if teacherDir == "" || studentDir == "" || len(caches) == 0 {
		return fmt.Errorf("--teacher, --student and at least one --cache are required")
	}
	var r cache.Range
	if _, err := fmt.Sscanf(rng, "%d:%d", &r.Start, &r.End); err != nil || r.End <= r.Start {
		return fmt.Errorf("--range %q: want S:E with S < E", rng)
	}
	teacher, err := train.LoadHF(teacherDir)
	if err != nil {
		return err
	}
	student, err := train.LoadHF(studentDir)
	if err != nil {
		return err
	}
	V := teacher.Cfg.VocabSize
	if student.Cfg.VocabSize != V {
		return fmt.Errorf("teacher vocab %d, student %d", V, student.Cfg.VocabSize)
	}
	type src struct {
		name  string
		rd    *cache.Reader
		m     cache.Manifest
		bytes int64 // its chunk files'
	}
	var srcs []src
	for _, c := range caches {
		name, dir, ok := strings.Cut(c, "=")
		if !ok {
			return fmt.Errorf("--cache %q: want NAME=DIR", c)
		}
		rd, err := cache.OpenReader(dir)
		if err != nil {
			return err
		}
		m := rd.Manifest()
		if m.VocabSize != V {
			return fmt.Errorf("cache %s: vocab %d, teacher %d", name, m.VocabSize, V)
		}
		if m.Temperature != 1 {
			return fmt.Errorf("cache %s: captured at temperature %g: this measures temperature 1", name, m.Temperature)
		}
		var bytes int64
		chunks, _ := filepath.Glob(filepath.Join(dir, "chunks", "*"))
		for _, f := range chunks {
			if fi, err := os.Stat(f); err == nil {
				bytes += fi.Size()
			}
		}
		srcs = append(srcs, src{name, rd, m, bytes})
	}
	var ms []*measure
	get := func(name string) *measure {
		for _, m := range ms {
			if m.name == name {
				return m
			}
		}
		m := &measure{name: name}
		ms = append(ms, m)
		return m
	}
	g, full := make([]float64, V), make([]float64, V)
	tokens := 0
	for i := r.Start; i < r.End; i++ {
		s0, err := srcs[0].rd.Get(i)
		if err != nil {
			return err
		}
		T := len(s0.Tokens)
		tokens += T
		b := &train.Batch{Tokens: s0.Tokens, Starts: []int32{0, int32(T)}, Mask: s0.Mask}
		lp, err := teacher.LogProbs(b)
		if err != nil {
			return err
		}
		lq, err := student.LogProbs(b)
		if err != nil {
			return err
		}
		rows := make([]cache.Sample, len(srcs))
		for j, c := range srcs {
			if rows[j], err = c.rd.Get(i); err != nil {
				return err
			}
			if len(rows[j].Tokens) != T {
				return fmt.Errorf("sample %d: cache %s has %d tokens, %s %d: not the same samples", i, c.name, len(rows[j].Tokens), srcs[0].name, T)
			}
		}
		for t := 0; t+1 < T; t++ {
			if s0.Mask[t+1] == 0 {
				continue // not a counted position
			}
			p, q := lp[t*V:(t+1)*V], lq[t*V:(t+1)*V]
			for v := range full {
				full[v] = math.Exp(float64(q[v])) - math.Exp(float64(p[v]))
			}
			for j, c := range srcs {
				row := rows[j]
				switch c.m.Kind() {
				case cache.TargetsTopK:
					k := c.m.K
					ids, lps := row.TopKIDs[t*k:(t+1)*k], row.TopKLogProbs[t*k:(t+1)*k]
					for _, mode := range []string{"bucket", "renormalize", "zero"} {
						topkGrad(g, q, ids, lps, mode)
						m := get(fmt.Sprintf("%s, tail %s", c.name, mode))
						m.add(g, full)
						m.bytes = float64(c.bytes)
					}
				default:
					sampledGrad(g, q, row, t, c.m)
					m := get(c.name)
					m.add(g, full)
					m.bytes = float64(c.bytes)
				}
			}
		}
	}
	sort.SliceStable(ms, func(a, b int) bool { return ms[a].bytes < ms[b].bytes })
	fmt.Printf("teacher %s, student %s, samples %v: %d tokens, %d counted positions\n", teacherDir, studentDir, r, tokens, ms[0].n)
	fmt.Printf("| target | cache bytes a token | mean angle to the full-KD gradient | mean cosine | angle, summed over positions |\n| --- | --- | --- | --- | --- |\n")
	for _, m := range ms {
		s := &measure{}
		s.add(m.sum, m.sumF)
		fmt.Printf("| %s | %.1f | %.1f° | %.4f | %.1f° |\n", m.name, m.bytes/float64(tokens), m.angle/float64(m.n), m.cos/float64(m.n), s.angle)
	}
	return nil
}

// topkGrad is the loss's gradient on the logits (temperature 1, fwd_kl)
// from a top-k row under a tail mode (train/loss's package doc).
func topkGrad(g []float64, lq []float32, ids []int32, lps []float32, mode string) {
	in := map[int32]float64{}
	var pk, qk float64
	for j, id := range ids {
		p := math.Exp(float64(lps[j]))
		in[id] = p
		pk += p
		qk += math.Exp(float64(lq[id]))
	}
	for v := range g {
		q := math.Exp(float64(lq[v]))
		p, ok := in[int32(v)]
		switch mode {
		case "bucket":
			if ok {
				g[v] = q - p
			} else {
				g[v] = q - (1-pk)*q/(1-qk)
			}
		case "renormalize":
			if ok {
				g[v] = q/qk - p/pk
			} else {
				g[v] = 0
			}
		case "zero":
			if ok {
				g[v] = q - p/pk
			} else {
				g[v] = q
			}
		}
	}
}

// sampledGrad is q - r for a sampled row (train/loss's package doc): r is
// count/N on the drawn ids (sampled), or the head's p and
// tail_mass·count/N on the drawn ids outside it (head+sampled).
func sampledGrad(g []float64, lq []float32, s cache.Sample, t int, m cache.Manifest) {
	for v := range g {
		g[v] = math.Exp(float64(lq[v]))
	}
	if m.Kind() == cache.TargetsHeadSampled {
		for j := t * m.K; j < (t+1)*m.K; j++ {
			g[s.TopKIDs[j]] -= math.Exp(float64(s.TopKLogProbs[j]))
		}
	}
	w := 1 / float64(m.Draws)
	if m.Kind() == cache.TargetsHeadSampled {
		w *= float64(s.TailMass[t])
	}
	off := 0
	for u := 0; u < t; u++ {
		off += int(s.DrawN[u])
	}
	for j := off; j < off+int(s.DrawN[t]); j++ {
		g[s.DrawIDs[j]] -= w * float64(s.DrawCounts[j])
	}
}
