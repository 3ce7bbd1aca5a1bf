package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"distill/compute/device"
	"distill/infer"
	"distill/internal/cli"
	"distill/internal/teacherdial"
	pb "distill/proto/distill/v1"
	"distill/serve"
)

func init() {
	commands.Register(&cli.Command{Name: "score", Summary: "print a teacher's top-k next tokens for token ids (in-process, or through teacherd)", Run: runScore})
}

func runScore(args []string) error {
	fs := flag.NewFlagSet("cachectl score", flag.ContinueOnError)
	modelDir := fs.String("model", "", "HF checkpoint directory: score in this process (or --teacher)")
	teacherAddr := fs.String("teacher", "", "teacherd address ADDR: score through the daemon (or --model)")
	var auth authFlags
	auth.register(fs)
	ids := fs.String("ids", "", `token ids: "1,2,3"; several samples separated by ";" (required)`)
	k := fs.Int("k", 5, "top-k tokens to print per position")
	temp := fs.Float64("temperature", 1, "capture temperature")
	dev := fs.String("device", "auto", "compute device: auto (a GPU when one opens, else the CPU), cpu or cuda")
	if err := cli.ParseFlags(fs, args); err != nil {
		return err
	}
	if err := noArgs(fs); err != nil {
		return err
	}
	if (*modelDir == "") == (*teacherAddr == "") || *ids == "" {
		fs.Usage()
		return cli.Usagef("--ids and one of --model DIR (in-process) and --teacher ADDR (a daemon) are required")
	}
	// Flags of the other mode were silently ignored, and bad values were
	// found only by the teacher (exit 1, naming no flag; --temperature 0
	// scored at 1).
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	switch {
	case *teacherAddr != "" && set["device"]:
		return cli.Usagef("--device is for --model; a daemon runs on the device it was started with (teacherd --device)")
	case *modelDir != "" && (set["token"] || set["token-file"] || set["tls-ca"]):
		return cli.Usagef("--token, --token-file and --tls-ca are for --teacher (a daemon); --model scores in this process")
	case *k < 1:
		return cli.Usagef("--k %d: want 1 or more (at most the teacher's vocabulary)", *k)
	case !(*temp > 0) || math.IsInf(*temp, 0):
		return cli.Usagef("--temperature %g: want a positive temperature (1: the teacher's own distribution)", *temp)
	}
	if err := device.Check(*dev, device.Inference); err != nil {
		return cli.Usage(err)
	}
	var samples [][]int32
	for i, part := range strings.Split(*ids, ";") {
		var s []int32
		fields := strings.Split(part, ",")
		for j, f := range fields {
			f = strings.TrimSpace(f)
			if f == "" && j > 0 && j < len(fields)-1 {
				// "1,,2" is a token id left out, not a separator typed
				// twice: the sample would be scored without it.
				return cli.Usagef("--ids: sample %d: an empty id between two commas (%q): give every token id", i, strings.TrimSpace(part))
			}
			if f == "" {
				continue
			}
			v, err := strconv.ParseInt(f, 10, 32)
			if err != nil {
				return cli.Usagef("--ids: sample %d: %q is not a token id", i, f)
			}
			s = append(s, int32(v))
		}
		// Found here, not by the teacher: a daemon printed the samples
		// before it and then failed with its gRPC status (exit 1).
		if len(s) == 0 {
			return cli.Usagef("--ids: sample %d is empty (a trailing or doubled \";\"?): give at least one token id per sample", i)
		}
		samples = append(samples, s)
	}
	if *teacherAddr != "" {
		o, err := auth.options()
		if err != nil {
			return err
		}
		return scoreRemote(*teacherAddr, o, samples, *k, float32(*temp))
	}
	be, err := device.Open(*dev, device.Options{Purpose: device.Inference,
		Logf: func(format string, args ...any) { fmt.Fprintf(os.Stderr, "score: "+format+"\n", args...) }})
	if err != nil {
		return err
	}
	defer device.Close(be)
	m, err := infer.Load(*modelDir, be)
	if err != nil {
		return err
	}
	res, err := m.TopK(samples, infer.Options{K: *k, Temperature: float32(*temp)})
	if err != nil {
		return err
	}
	fmt.Printf("teacher %s (%s, %.2fM params, vocab %d), fingerprint %.12s, on %s\n", *modelDir, m.Cfg.Arch, float64(m.Cfg.Params())/1e6, m.Cfg.VocabSize, m.Fingerprint(), be.Name())
	for i, s := range samples {
		printTopK(i, s, *k, res[i].IDs, res[i].LogProbs)
	}
	return nil
}

// printTopK prints one sample's top-k at every position.
func printTopK(i int, s []int32, k int, ids []int32, logProbs []float32) {
	fmt.Printf("sample %d:\n", i)
	for p, tok := range s {
		var b strings.Builder
		for j := 0; j < k; j++ {
			e := p*k + j
			fmt.Fprintf(&b, " %d:%.4f", ids[e], math.Exp(float64(logProbs[e])))
		}
		fmt.Printf("  pos %d token %d -> top-%d (id:prob)%s\n", p, tok, k, b.String())
	}
}

// scoreRemote is `cachectl score --teacher ADDR`: the samples scored by a
// teacherd daemon through its Score stream, printed as in-process.
func scoreRemote(addr string, o serve.DialOptions, samples [][]int32, k int, temp float32) error {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	conn, err := teacherdial.Dial(addr, o)
	if err != nil {
		return err
	}
	defer conn.Close()
	c := pb.NewTeacherClient(conn)
	info, err := c.Info(ctx, &pb.InfoRequest{})
	if err != nil {
		// As fill says it: the gRPC status's message, and what to check.
		hint := "is it running? check the address, --token-file and --tls-ca"
		if c := status.Code(err); c == codes.Unauthenticated || c == codes.PermissionDenied {
			hint = "give the daemon's bearer token with --token-file, --token or $DISTILL_TOKEN"
		}
		return fmt.Errorf("teacher %s: Info: %s (%s)", addr, teacherdial.Message(err), hint)
	}
	// The daemon's messages, not gRPC's "rpc error: code = ... desc =
	// ...". A Send fails with io.EOF once the daemon has ended the
	// stream; Recv then says why.
	stream, err := c.Score(ctx)
	if err != nil {
		return fmt.Errorf("teacher %s: %s", addr, teacherdial.Message(err))
	}
	kk := int32(k)
	for i, s := range samples {
		if err := stream.Send(&pb.ScoreRequest{Id: int64(i), Tokens: s, K: &kk, Temperature: temp}); err != nil {
			if errors.Is(err, io.EOF) {
				break
			}
			return fmt.Errorf("teacher %s: %s", addr, teacherdial.Message(err))
		}
	}
	if err := stream.CloseSend(); err != nil {
		return fmt.Errorf("teacher %s: %s", addr, teacherdial.Message(err))
	}
	fmt.Printf("teacher %s (%s, %.2fM params, vocab %d), fingerprint %.12s, on %s\n", addr, info.Architecture, float64(info.Params)/1e6, info.VocabSize, info.TeacherFingerprint, info.Device)
	for i, s := range samples {
		r, err := stream.Recv()
		if err != nil {
			return fmt.Errorf("teacher %s: sample %d: %s", addr, i, teacherdial.Message(err))
		}
		printTopK(i, s, int(r.K), r.Ids, r.Logprobs)
	}
	return nil
}
