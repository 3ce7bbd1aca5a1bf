package serve

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"math/rand"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"distill/cache"
	pb "distill/proto/distill/v1"
)

// TestScoreSampledMatchesFill: a Score of sample i of a sampled kind,
// keyed by the dataset's fingerprint and i, answers exactly what a Fill
// of that dataset stores for sample i: the head bit for bit, the drawn
// ids, their counts and the tail mass (lossless encoding). Every sample
// has 16 to 30 tokens against a token budget of 30, so each fill forward
// holds one sample, as each Score does on an idle daemon: the same
// forward, the same probabilities. A sample scored under another index
// draws other ids (the key is used).
func TestScoreSampledMatchesFill(t *testing.T) {
	mdir := tinyModel(t)
	tmp := t.TempDir()
	path := filepath.Join(tmp, "data.jsonl")
	r := rand.New(rand.NewSource(11))
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 6; i++ {
		ids := make([]int32, 16+r.Intn(15))
		for j := range ids {
			ids[j] = int32(r.Intn(512))
		}
		b, _ := json.Marshal(map[string]any{"input_ids": ids})
		fmt.Fprintf(f, "%s\n", b)
	}
	f.Close()
	ds := &pb.Dataset{Sources: []*pb.DataSource{{Path: path}}, Pretokenized: true}
	for _, tc := range []struct {
		kind cache.Targets
		k    int32
	}{{cache.TargetsSampled, 0}, {cache.TargetsHeadSampled, 4}} {
		t.Run(string(tc.kind), func(t *testing.T) {
			cdir := t.TempDir()
			d := startDaemon(t, Config{Model: mdir, Cache: cdir, TokenBudget: 30, DataRoots: []string{tmp}})
			cl, conn := dialTeacher(t, d.Addr(), "")
			defer conn.Close()
			desc, err := cl.DescribeDataset(context.Background(), &pb.DescribeDatasetRequest{Dataset: ds})
			if err != nil {
				t.Fatal(err)
			}
			fr := &pb.FillRequest{Dataset: ds, Start: 0, End: 6, ChunkSamples: 4, Encoding: "lossless", Targets: string(tc.kind), Samples: 24}
			if tc.k > 0 {
				fr.K = proto.Int32(tc.k)
			}
			fs, err := cl.Fill(context.Background(), fr)
			if err != nil {
				t.Fatal(err)
			}
			for {
				if _, err := fs.Recv(); err != nil {
					if status.Code(err) != codes.OK && err.Error() != "EOF" {
						t.Fatal(err)
					}
					break
				}
			}
			rd, err := cache.OpenReader(cdir)
			if err != nil {
				t.Fatal(err)
			}
			st, err := cl.Score(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			ask := func(id int64, tokens []int32, index int64) *pb.ScoreResponse {
				t.Helper()
				q := &pb.ScoreRequest{Id: id, Tokens: tokens, Targets: string(tc.kind), Samples: 24, DatasetFingerprint: desc.GetFingerprint(), SampleIndex: index}
				if tc.k > 0 {
					q.K = proto.Int32(tc.k)
				}
				if err := st.Send(q); err != nil {
					t.Fatal(err)
				}
				res, err := st.Recv()
				if err != nil {
					t.Fatal(err)
				}
				return res
			}
			moved := 0
			for i := int64(0); i < 6; i++ {
				want, err := rd.Get(i)
				if err != nil {
					t.Fatal(err)
				}
				got := ask(i, want.Tokens, i)
				T := len(want.Tokens)
				if got.GetK() != tc.k || len(got.GetIds()) != T*int(tc.k) || len(got.GetDrawN()) != T {
					t.Fatalf("sample %d: k %d, %d ids, %d draw_n for %d tokens", i, got.GetK(), len(got.GetIds()), len(got.GetDrawN()), T)
				}
				if !slices.Equal(got.GetIds(), want.TopKIDs) || !sameBits(got.GetLogprobs(), want.TopKLogProbs) {
					t.Fatalf("sample %d: head %v %v, the fill's %v %v", i, got.GetIds(), got.GetLogprobs(), want.TopKIDs, want.TopKLogProbs)
				}
				if !slices.Equal(got.GetDrawN(), want.DrawN) || !slices.Equal(got.GetDrawIds(), want.DrawIDs) || !slices.Equal(got.GetDrawCounts(), want.DrawCounts) {
					t.Fatalf("sample %d: draws n %v ids %v counts %v, the fill's %v %v %v", i, got.GetDrawN(), got.GetDrawIds(), got.GetDrawCounts(), want.DrawN, want.DrawIDs, want.DrawCounts)
				}
				if !sameBits(got.GetTailMass(), want.TailMass) {
					t.Fatalf("sample %d: tail %v, the fill's %v", i, got.GetTailMass(), want.TailMass)
				}
				// The same tokens under another index: other uniforms.
				other := ask(100+i, want.Tokens, i+1000)
				if !slices.Equal(other.GetDrawIds(), want.DrawIDs) || !slices.Equal(other.GetDrawCounts(), want.DrawCounts) {
					moved++
				}
			}
			if moved == 0 {
				t.Fatalf("scores under other sample indexes drew the same ids and counts at all 6 samples: the key is not used")
			}
			st.CloseSend()
		})
	}
}

// sameBits reports whether a and b hold the same float32 bits.
func sameBits(a, b []float32) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if math.Float32bits(a[i]) != math.Float32bits(b[i]) {
			return false
		}
	}
	return true
}

// TestScoreSampledRefusals: a Score of a sampled kind without its key,
// with more draws than the daemon plans for, or draws asked with top-k,
// is InvalidArgument naming what is wrong and how to fix it.
func TestScoreSampledRefusals(t *testing.T) {
	mdir := tinyModel(t)
	d := startDaemon(t, Config{Model: mdir})
	cl, conn := dialTeacher(t, d.Addr(), "")
	defer conn.Close()
	toks := []int32{1, 2, 3}
	for _, c := range []struct {
		r    *pb.ScoreRequest
		want string
	}{
		{&pb.ScoreRequest{Tokens: toks, Targets: "sampled", Samples: 8}, "without dataset_fingerprint: the draws are keyed by the dataset's fingerprint and the sample's index"},
		{&pb.ScoreRequest{Tokens: toks, Targets: "sampled", Samples: 65, DatasetFingerprint: "x"}, "samples 65 with targets sampled: want 1 to 64 draws per position (the daemon plans its device memory for 64: teacherd --max-draws)"},
		{&pb.ScoreRequest{Tokens: toks, Targets: "head+sampled", Samples: 0, DatasetFingerprint: "x"}, "samples 0 with targets head+sampled"},
		{&pb.ScoreRequest{Tokens: toks, Targets: "sampled", Samples: 8, DatasetFingerprint: "x", SampleIndex: -1}, "sample_index -1"},
		{&pb.ScoreRequest{Tokens: toks, Samples: 8}, "with targets topk: draws and their key belong to targets sampled or head+sampled"},
		{&pb.ScoreRequest{Tokens: toks, Targets: "all"}, `targets "all": want topk, sampled or head+sampled`},
	} {
		err := scoreOnce(cl, c.r)
		if status.Code(err) != codes.InvalidArgument || !strings.Contains(status.Convert(err).Message(), c.want) {
			t.Errorf("%v: %v, want InvalidArgument with %q", c.r, err, c.want)
		}
	}
	in, err := cl.Info(context.Background(), &pb.InfoRequest{})
	if err != nil || in.GetMaxDraws() != DefaultMaxDraws {
		t.Fatalf("Info max_draws %d (%v), want %d", in.GetMaxDraws(), err, DefaultMaxDraws)
	}
}
