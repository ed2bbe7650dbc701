// A Node client of tessera's public gRPC API, driven by tests/stack/test_node_client.py.
//
// It loads the .proto files as they are (include root: protos/, @grpc/proto-loader) and calls
// FrontendService with @grpc/grpc-js, as any Node caller would. Usage:
//
//   node client.mjs <scenario> <frontend host:port> <protos dir>
//
// with the packages installed in the directory $TESSERA_NPM_DIR (its node_modules). Each
// scenario prints one JSON object on stdout, the last line (the cancel scenario prints
// {"streaming": tokens} first, then waits for a line on stdin before it cancels):
//   stream      a greedy Generate: every message as it came ({text, token_ids, finish_reason, usage})
//   cancel      a long Generate cancelled mid-stream: {received, code}
//   deadline    a long Generate with a 300 ms deadline: {code, details, messages}
//   bad_field   Generate with sampling_params.temperature -1: {code, details}
//   models      ListModels and GetServerInfo: {models, info}
import { createRequire } from "node:module";
import path from "node:path";
import readline from "node:readline";

const require = createRequire(path.join(process.env.TESSERA_NPM_DIR, "package.json"));
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const [scenario, address, protosDir] = process.argv.slice(2);

// snake_case field names as the .proto has them; enums by name; 64-bit ints as strings
const definition = protoLoader.loadSync("tessera/v1/frontend.proto", {
  includeDirs: [protosDir], keepCase: true, longs: String, enums: String, defaults: true, oneofs: true,
});
const tessera = grpc.loadPackageDefinition(definition).tessera.v1;
const client = new tessera.FrontendService(address, grpc.credentials.createInsecure());

const LONG_STORY = {
  chat: { messages: [{ role: "user", content: "Write a very long story about a dragon." }] },
  sampling_params: { temperature: 0, max_tokens: 400, ignore_eos: true },
};

// A call's outcome, reported once: grpc-js may emit "end" after "error" on a failed stream.
let reported = false;
function done(result) {
  if (reported) return;
  reported = true;
  process.stdout.write(JSON.stringify(result) + "\n");
  client.close();
}

function statusName(code) {
  return Object.keys(grpc.status).find((name) => grpc.status[name] === code);
}

function seconds(s) {
  return new Date(Date.now() + s * 1000);
}

const scenarios = {
  stream() {
    const messages = [];
    const call = client.Generate({
      chat: { messages: [{ role: "user", content: "What is the capital of France? Answer in one sentence." }] },
      sampling_params: { temperature: 0, max_tokens: 24, ignore_eos: true },
    }, { deadline: seconds(120) });
    call.on("data", (m) => messages.push({
      request_id: m.request_id, text: m.text, token_ids: m.token_ids, finish_reason: m.finish_reason,
      usage: m.usage,
    }));
    call.on("error", (e) => done({ code: statusName(e.code), details: e.details, messages }));
    call.on("end", () => done({ code: "OK", messages }));
  },

  cancel() {
    let received = 0;
    let asked = false;
    const call = client.Generate(LONG_STORY, { deadline: seconds(120) });
    call.on("data", (m) => {
      received += m.token_ids.length;
      if (received >= 3 && !asked) {
        asked = true;
        // the test checks the engine runs it, then says go
        process.stdout.write(JSON.stringify({ streaming: received }) + "\n");
        readline.createInterface({ input: process.stdin }).once("line", () => call.cancel());
      }
    });
    call.on("error", (e) => { done({ received, code: statusName(e.code) }); process.exit(0); });
    call.on("end", () => { done({ received, code: "OK" }); process.exit(0); });
  },

  deadline() {
    let messages = 0;
    const call = client.Generate(LONG_STORY, { deadline: seconds(0.3) });
    call.on("data", () => { messages += 1; });
    call.on("error", (e) => done({ code: statusName(e.code), details: e.details, messages }));
    call.on("end", () => done({ code: "OK", messages }));
  },

  bad_field() {
    const call = client.Generate({
      text: "Hello", sampling_params: { temperature: -1, max_tokens: 4 },
    }, { deadline: seconds(60) });
    call.on("data", () => {});
    call.on("error", (e) => done({ code: statusName(e.code), details: e.details }));
    call.on("end", () => done({ code: "OK" }));
  },

  models() {
    const deadline = seconds(60);
    client.ListModels({}, { deadline }, (e1, models) => {
      if (e1) return done({ code: statusName(e1.code), details: e1.details });
      client.GetServerInfo({}, { deadline }, (e2, info) => {
        if (e2) return done({ code: statusName(e2.code), details: e2.details });
        done({ code: "OK", models: models.models, info });
      });
    });
  },
};

if (!scenarios[scenario]) {
  process.stderr.write(`unknown scenario ${scenario}: one of ${Object.keys(scenarios).join(", ")}\n`);
  process.exit(2);
}
scenarios[scenario]();
